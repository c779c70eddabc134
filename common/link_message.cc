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

std::vector<v1::LinkFrame> SplitIntoFrames(const LinkMessage& message,
                                           size_t frame_bytes) {
  std::vector<v1::LinkFrame> frames;
  const size_t total = message.payload.size();
  size_t offset = 0;
  do {
    v1::LinkFrame frame;
    if (offset == 0) *frame.mutable_header() = message.header;
    const size_t n = std::min(frame_bytes, total - offset);
    frame.set_data(message.payload.substr(offset, n));
    offset += n;
    frame.set_last(offset == total);
    frames.push_back(std::move(frame));
  } while (offset < total);
  return frames;
}

absl::StatusOr<std::optional<LinkMessage>> FrameAssembler::Add(
    v1::LinkFrame frame) {
  if (!in_message_) {
    if (!frame.has_header()) {
      return absl::InvalidArgumentError(
          "first frame of a message has no header");
    }
    uint64_t expected = 0;
    for (const v1::TensorHeader& tensor : frame.header().tensors()) {
      if (tensor.payload_bytes() > max_message_bytes_ - expected) {
        return absl::InvalidArgumentError(absl::StrCat(
            "message of more than ", max_message_bytes_, " bytes refused"));
      }
      expected += tensor.payload_bytes();
    }
    current_ = LinkMessage();
    current_.header = std::move(*frame.mutable_header());
    expected_bytes_ = expected;
    in_message_ = true;
  } else if (frame.has_header()) {
    return absl::InvalidArgumentError(
        "frame with a header in the middle of a message");
  }
  if (current_.payload.size() + frame.data().size() > expected_bytes_) {
    in_message_ = false;
    return absl::InvalidArgumentError(absl::StrCat(
        "frames carry more than the ", expected_bytes_,
        " payload bytes the header announced"));
  }
  current_.payload.append(frame.data());
  if (!frame.last()) return std::optional<LinkMessage>();
  in_message_ = false;
  if (current_.payload.size() != expected_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("message ended after ", current_.payload.size(),
                     " payload bytes; header announced ", expected_bytes_));
  }
  return std::optional<LinkMessage>(std::move(current_));
}

absl::Status CheckTensorHeader(const v1::TensorHeader& header) {
  const size_t element = DTypeSize(header.dtype());
  if (element == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dtype ", static_cast<int>(header.dtype())));
  }
  if (header.codec() != v1::CODEC_NONE) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown codec ", static_cast<int>(header.codec())));
  }
  uint64_t elements = 1;
  for (int64_t dim : header.shape()) {
    if (dim < 0) return absl::InvalidArgumentError("negative dimension");
    if (dim > 0 && elements > kMaxMessageBytes / static_cast<uint64_t>(dim)) {
      return absl::InvalidArgumentError("shape too large");
    }
    elements *= static_cast<uint64_t>(dim);
  }
  if (elements > kMaxMessageBytes / element ||
      elements * element != header.payload_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload of ", header.payload_bytes(), " bytes does not match shape [",
        absl::StrJoin(header.shape(), ","), "]"));
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
  if (header.dtype() != v1::DTYPE_FLOAT32) return absl::OkStatus();
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
