#include "common/link_message.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace geotrain {

size_t DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return 4;
    case v1::DTYPE_INT64:
      return 8;
    case v1::DTYPE_FLOAT16:
    case v1::DTYPE_BFLOAT16:
      return 2;
    default:
      return 0;
  }
}

std::vector<FrameRange> FrameRanges(size_t message_bytes, size_t frame_bytes) {
  std::vector<FrameRange> ranges;
  size_t offset = 0;
  do {
    FrameRange range;
    range.offset = offset;
    range.size = std::min(frame_bytes, message_bytes - offset);
    offset += range.size;
    range.last = offset == message_bytes;
    ranges.push_back(range);
  } while (offset < message_bytes);
  return ranges;
}

std::vector<v1::LinkFrame> SplitIntoFrames(const LinkMessage& message,
                                           size_t frame_bytes) {
  std::vector<v1::LinkFrame> frames;
  for (const FrameRange& range : FrameRanges(message.payload.size(), frame_bytes)) {
    v1::LinkFrame frame;
    if (range.offset == 0) *frame.mutable_header() = message.header;
    frame.set_data(message.payload.substr(range.offset, range.size));
    frame.set_last(range.last);
    frames.push_back(std::move(frame));
  }
  return frames;
}

absl::StatusOr<std::optional<LinkMessage>> FrameAssembler::Add(v1::LinkFrame frame) {
  FrameParts parts;
  if (frame.has_header()) parts.header = std::move(*frame.mutable_header());
  if (!frame.data().empty()) parts.data.push_back(frame.data());
  parts.data_bytes = frame.data().size();
  parts.last = frame.last();
  return Add(std::move(parts));
}

absl::StatusOr<std::optional<LinkMessage>> FrameAssembler::Add(FrameParts frame) {
  if (!in_message_) {
    if (!frame.header.has_value()) {
      return absl::InvalidArgumentError(
          "first frame of a message has no header");
    }
    uint64_t expected = 0;
    for (const v1::TensorHeader& tensor : frame.header->tensors()) {
      if (tensor.payload_bytes() > max_message_bytes_ - expected) {
        return absl::InvalidArgumentError(absl::StrCat(
            "message of more than ", max_message_bytes_, " bytes refused"));
      }
      expected += tensor.payload_bytes();
    }
    if (check_header_ != nullptr) {
      if (absl::Status valid = check_header_(*frame.header); !valid.ok()) return valid;
    }
    current_ = LinkMessage();
    current_.header = std::move(*frame.header);
    expected_bytes_ = expected;
    // Checked against the plan (when a check is set): reserve it all once.
    if (check_header_ != nullptr) current_.payload.reserve(expected);
    in_message_ = true;
  } else if (frame.header.has_value()) {
    return absl::InvalidArgumentError(
        "frame with a header in the middle of a message");
  }
  if (current_.payload.size() + frame.data_bytes > expected_bytes_) {
    in_message_ = false;
    return absl::InvalidArgumentError(absl::StrCat(
        "frames carry more than the ", expected_bytes_,
        " payload bytes the header announced"));
  }
  for (absl::string_view piece : frame.data) current_.payload.append(piece.data(), piece.size());
  PayloadCopies().wire_to_payload.fetch_add(frame.data_bytes, std::memory_order_relaxed);
  if (!frame.last) return std::optional<LinkMessage>();
  in_message_ = false;
  if (current_.payload.size() != expected_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("message ended after ", current_.payload.size(),
                     " payload bytes; header announced ", expected_bytes_));
  }
  return std::optional<LinkMessage>(std::move(current_));
}

absl::StatusOr<uint64_t> EncodedSizeBound(v1::Codec codec, uint64_t elements,
                                          uint32_t block_size, bool* exact) {
  *exact = true;
  switch (codec) {
    case v1::CODEC_NONE:
      return elements * 4;
    case v1::CODEC_FP16:
    case v1::CODEC_BF16:
      return elements * 2;
    case v1::CODEC_INT8:
    case v1::CODEC_INT4: {
      if (block_size == 0 || block_size > (1u << 20)) {
        return absl::InvalidArgumentError(absl::StrCat("block size ", block_size));
      }
      auto block_bytes = [&](uint64_t count) {
        return 4 + (codec == v1::CODEC_INT8 ? count : (count + 1) / 2);
      };
      const uint64_t full = elements / block_size, rest = elements % block_size;
      return full * block_bytes(block_size) + (rest ? block_bytes(rest) : 0);
    }
    case v1::CODEC_TOPK:
      *exact = false;
      return 4 + 8 * elements;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown codec ", static_cast<int>(codec)));
  }
}

absl::Status CheckTensorHeader(const v1::TensorHeader& header) {
  const size_t element = DTypeSize(header.dtype());
  if (element == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dtype ", static_cast<int>(header.dtype())));
  }
  if (header.codec() != v1::CODEC_NONE && header.dtype() != v1::DTYPE_FLOAT32) {
    return absl::InvalidArgumentError("codecs other than none apply to float32 only");
  }
  uint64_t elements = 1;
  for (int64_t dim : header.shape()) {
    if (dim < 0) return absl::InvalidArgumentError("negative dimension");
    if (dim > 0 && elements > kMaxMessageBytes / static_cast<uint64_t>(dim)) {
      return absl::InvalidArgumentError("shape too large");
    }
    elements *= static_cast<uint64_t>(dim);
  }
  if (elements > kMaxMessageBytes / element) {
    return absl::InvalidArgumentError("shape too large");
  }
  if (header.codec() == v1::CODEC_NONE && !header.zstd()) {
    if (elements * element != header.payload_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "payload of ", header.payload_bytes(), " bytes does not match shape [",
          absl::StrJoin(header.shape(), ","), "]"));
    }
    return absl::OkStatus();
  }
  bool exact = true;
  absl::StatusOr<uint64_t> bound =
      header.codec() == v1::CODEC_NONE
          ? absl::StatusOr<uint64_t>(elements * element)
          : EncodedSizeBound(header.codec(), elements, header.block_size(), &exact);
  if (!bound.ok()) return bound.status();
  if (exact ? header.encoded_bytes() != *bound : header.encoded_bytes() > *bound) {
    return absl::InvalidArgumentError(absl::StrCat(
        "encoding of ", header.encoded_bytes(), " bytes does not fit ", elements, " elements (",
        exact ? "exactly " : "at most ", *bound, ")"));
  }
  const uint64_t wire_bound =
      header.zstd() ? header.encoded_bytes() + header.encoded_bytes() / 128 + 1024
                    : header.encoded_bytes();
  if (header.zstd() ? header.payload_bytes() > wire_bound
                    : header.payload_bytes() != header.encoded_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("payload of ", header.payload_bytes(),
                                                   " bytes for an encoding of ",
                                                   header.encoded_bytes()));
  }
  return absl::OkStatus();
}

absl::Status CheckTensorMatches(const v1::TensorHeader& header,
                                const TensorSpec& spec, const char* what) {
  absl::Status basic = CheckTensorHeader(header);
  if (!basic.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", basic.message()));
  }
  bool shape_ok = header.shape_size() == static_cast<int>(spec.shape.size());
  for (int i = 0; shape_ok && i < header.shape_size(); ++i) {
    shape_ok = i == 0 ? (header.shape(0) >= 1 && header.shape(0) <= spec.shape[0])
                      : header.shape(i) == spec.shape[i];
  }
  if (!shape_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": shape [", absl::StrJoin(header.shape(), ","),
        "] but the plan expects [", absl::StrJoin(spec.shape, ","), "]"));
  }
  if (header.dtype() != spec.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": dtype ", v1::DType_Name(header.dtype()),
        " but the plan expects ", v1::DType_Name(spec.dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(const v1::TensorHeader& header,
                         const std::string& payload, size_t offset) {
  // Encoded tensors are checked after decoding (tensor_wire.cc).
  if (header.dtype() != v1::DTYPE_FLOAT32 || header.codec() != v1::CODEC_NONE ||
      header.zstd()) {
    return absl::OkStatus();
  }
  const size_t n = header.payload_bytes() / 4;
  const char* data = payload.data() + offset;
  for (size_t i = 0; i < n; ++i) {
    float value;
    std::memcpy(&value, data + 4 * i, 4);
    if (!std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("non-finite value at element ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace geotrain
