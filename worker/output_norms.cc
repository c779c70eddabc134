#include "worker/output_norms.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/status_macros.h"

namespace geotrain {
namespace {

// Sum of squares of one float32 tensor at `offset`; `scratch` holds the
// decoded values of an encoded one.
absl::StatusOr<double> SumOfSquares(const v1::TensorHeader& header, const std::string& payload,
                                    size_t offset, uint64_t elements, std::vector<float>* scratch) {
  absl::string_view bytes(payload.data() + offset, header.payload_bytes());
  std::string decompressed;
  if (header.zstd()) {
    ASSIGN_OR_RETURN(decompressed, ZstdDecompress(bytes, header.encoded_bytes()));
    bytes = decompressed;
  }
  double sum = 0;
  if (header.codec() == v1::CODEC_NONE) {
    if (bytes.size() != elements * sizeof(float)) {
      return absl::InvalidArgumentError("a float32 tensor's bytes do not match its shape");
    }
    // Read in place: a raw tensor needs no decoded copy.
    for (uint64_t i = 0; i < elements; ++i) {
      float value;
      std::memcpy(&value, bytes.data() + i * sizeof(float), sizeof(float));
      sum += static_cast<double>(value) * value;
    }
    return sum;
  }
  CodecOptions options;
  options.block_size = static_cast<int>(header.block_size());
  ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(header.codec(), options));
  scratch->resize(elements);
  RETURN_IF_ERROR(codec->Decode(bytes, elements, scratch->data()));
  const float* values = scratch->data();
  for (uint64_t i = 0; i < elements; ++i) sum += static_cast<double>(values[i]) * values[i];
  return sum;
}

absl::StatusOr<double> FloatRmsWith(const LinkMessage& message, std::vector<float>* scratch) {
  double sum = 0;
  uint64_t count = 0;
  size_t offset = 0;
  for (const v1::TensorHeader& header : message.header.tensors()) {
    RETURN_IF_ERROR(CheckTensorHeader(header));
    if (offset > message.payload.size() ||
        message.payload.size() - offset < header.payload_bytes()) {
      return absl::InvalidArgumentError("a tensor runs past the payload");
    }
    if (header.dtype() == v1::DTYPE_FLOAT32) {
      uint64_t elements = 1;
      for (int64_t d : header.shape()) elements *= static_cast<uint64_t>(d);
      if (elements > kMaxDecodeElements) {
        return absl::InvalidArgumentError(absl::StrCat("a tensor of ", elements, " elements"));
      }
      ASSIGN_OR_RETURN(const double part,
                       SumOfSquares(header, message.payload, offset, elements, scratch));
      sum += part;
      count += elements;
    }
    offset += header.payload_bytes();
  }
  return count == 0 ? 0.0 : std::sqrt(sum / static_cast<double>(count));
}

}  // namespace

absl::StatusOr<double> FloatRms(const LinkMessage& message) {
  std::vector<float> scratch;
  return FloatRmsWith(message, &scratch);
}

void OutputNormMeter::Observe(const LinkMessage& message) {
  const v1::MessageKind kind = message.header.kind();
  if (kind != v1::MESSAGE_KIND_ACTIVATION && kind != v1::MESSAGE_KIND_GRADIENT) return;
  absl::StatusOr<double> rms = FloatRmsWith(message, &scratch_);
  if (!rms.ok() || !std::isfinite(*rms)) return;
  rms_ = messages_ == 0 ? *rms : (1 - weight_) * rms_ + weight_ * *rms;
  ++messages_;
  const int step = message.header.step();
  if (step < 0) return;
  newest_step_ = std::max(newest_step_, step);
  if (step % kSampleStride != 0) return;
  StepSum& sum = samples_[step];
  sum.mean_squares += *rms * *rms;
  ++sum.messages;
  while (samples_.size() > kReportedSamples + 1) samples_.erase(samples_.begin());
}

std::vector<StepRms> OutputNormMeter::CompleteSamples() const {
  std::vector<StepRms> out;
  for (const auto& [step, sum] : samples_) {
    if (step >= newest_step_) break;  // messages of it may still come
    out.push_back({step, std::sqrt(sum.mean_squares / sum.messages), sum.messages});
  }
  if (out.size() > kReportedSamples) out.erase(out.begin(), out.end() - kReportedSamples);
  return out;
}

}  // namespace geotrain
