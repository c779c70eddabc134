// Codecs for float32 tensors on the wire: one small class per format behind
// one interface. The encoded payload is self-checking: Decode() verifies its
// length against the element count (and, for sparse formats, every index)
// before it writes a single value, so a malformed payload is an error, never
// a crash.
//
// Formats (TensorHeader.codec):
//   none  raw float32
//   fp16  IEEE half; finite values beyond its range saturate to +-65504;
//         relative error <= 2^-11 inside the range
//   bf16  bfloat16, round to nearest even; relative error <= 2^-8
//   int8  blocks of `block_size` (default 64): a float32 scale = absmax/127,
//         then one int8 per value; error per value <= absmax/254
//   int4  blocks: float32 scale = absmax/7, two signed 4-bit values per
//         byte; error per value <= absmax/14
//   topk  the ceil(fraction * n) largest magnitudes as (uint32 index, float
//         value) pairs in increasing index order; the rest decode as 0. With
//         error feedback the encoder adds what it left out last time to the
//         next tensor it encodes (use one encoder per repeatedly sent tensor).
// Any of them may be followed by zstd (TensorHeader.zstd).
//
// NaN/Inf policy: encoders refuse non-finite input (INVALID_ARGUMENT); a
// sender never puts one on the wire, and receivers refuse non-finite tensors.
//
// Encoders with error feedback keep state and are not thread-safe; the
// others are stateless and thread-safe.
#ifndef GEOTRAIN_COMMON_CODEC_H_
#define GEOTRAIN_COMMON_CODEC_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "geotrain/v1/tensor.pb.h"

namespace geotrain {

struct CodecOptions {
  int block_size = 64;          // int8, int4
  double topk_fraction = 0.01;  // topk
  bool error_feedback = false;  // topk
};

class Codec {
 public:
  virtual ~Codec() = default;
  virtual v1::Codec id() const = 0;
  // Appends the encoding of `values[0, n)` to `out`.
  virtual absl::Status Encode(const float* values, size_t n, std::string* out) = 0;
  // Decodes `payload` into `out[0, n)`. INVALID_ARGUMENT when the payload
  // does not match n (length, indices, scales).
  virtual absl::Status Decode(absl::string_view payload, size_t n, float* out) const = 0;
};

// Decoders refuse element counts above this (1 GiB of float32) before
// touching memory.
inline constexpr size_t kMaxDecodeElements = size_t{1} << 28;

// INVALID_ARGUMENT for CODEC_UNSPECIFIED, unknown ids and bad options.
absl::StatusOr<std::unique_ptr<Codec>> MakeCodec(v1::Codec id,
                                                 const CodecOptions& options = {});

// "none", "fp16", "bf16", "int8", "int4", "topk" <-> v1::Codec.
absl::StatusOr<v1::Codec> ParseCodecName(const std::string& name);
std::string CodecName(v1::Codec id);

// zstd around an encoded payload. Decompression refuses output larger than
// `max_bytes` (from the header) before allocating it.
absl::Status ZstdCompress(absl::string_view in, int level, std::string* out);
absl::StatusOr<std::string> ZstdDecompress(absl::string_view in, size_t max_bytes);
// Without decoding anything: OK when `frame` is exactly one zstd frame that
// declares its content size, and that size is `content_bytes` (what the
// tensor's header announces; CheckTensorHeader has tied it to the shape).
// INVALID_ARGUMENT saying what does not fit.
absl::Status CheckZstdFrameHeader(absl::string_view frame, uint64_t content_bytes);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_CODEC_H_
