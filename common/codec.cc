#include "common/codec.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

constexpr float kHalfMax = 65504.0f;

absl::Status CheckFiniteInput(const float* values, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("refusing to encode a non-finite value at element ", i));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDecodeSize(size_t n) {
  if (n > kMaxDecodeElements) {
    return absl::InvalidArgumentError(absl::StrCat("refusing to decode ", n, " elements"));
  }
  return absl::OkStatus();
}

absl::Status LengthError(const char* codec, size_t got, size_t want) {
  return absl::InvalidArgumentError(
      absl::StrCat(codec, " payload of ", got, " bytes; expected ", want));
}

template <typename T>
void Append(std::string* out, const T& value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

template <typename T>
T Load(const char* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

class RawCodec : public Codec {
 public:
  v1::Codec id() const override { return v1::CODEC_NONE; }
  absl::Status Encode(const float* values, size_t n, std::string* out) override {
    if (absl::Status s = CheckFiniteInput(values, n); !s.ok()) return s;
    out->append(reinterpret_cast<const char*>(values), n * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status Decode(absl::string_view payload, size_t n, float* out) const override {
    if (absl::Status s = CheckDecodeSize(n); !s.ok()) return s;
    if (payload.size() != n * sizeof(float)) return LengthError("none", payload.size(), n * 4);
    // Found by tensor_decode_fuzz: memcpy of nothing from/to null is undefined.
    if (n > 0) std::memcpy(out, payload.data(), payload.size());
    return absl::OkStatus();
  }
};

// Two-byte float formats: fp16 (saturating) and bf16.
template <typename Half, v1::Codec kId>
class HalfCodec : public Codec {
 public:
  v1::Codec id() const override { return kId; }
  absl::Status Encode(const float* values, size_t n, std::string* out) override {
    if (absl::Status s = CheckFiniteInput(values, n); !s.ok()) return s;
    const size_t start = out->size();
    out->resize(start + 2 * n);
    char* dst = out->data() + start;
    for (size_t i = 0; i < n; ++i) {
      float v = values[i];
      if (kId == v1::CODEC_FP16) v = std::clamp(v, -kHalfMax, kHalfMax);
      const Half h(v);
      std::memcpy(dst + 2 * i, &h.x, 2);
    }
    return absl::OkStatus();
  }
  absl::Status Decode(absl::string_view payload, size_t n, float* out) const override {
    if (absl::Status s = CheckDecodeSize(n); !s.ok()) return s;
    if (payload.size() != 2 * n) return LengthError(CodecName(kId).c_str(), payload.size(), 2 * n);
    for (size_t i = 0; i < n; ++i) {
      Half h;
      std::memcpy(&h.x, payload.data() + 2 * i, 2);
      out[i] = static_cast<float>(h);
    }
    return absl::OkStatus();
  }
};

// Blockwise absmax quantisation to `bits` (8: [-127, 127], 4: [-7, 7]).
template <int kBits>
class BlockCodec : public Codec {
 public:
  explicit BlockCodec(int block) : block_(static_cast<size_t>(block)) {}
  v1::Codec id() const override { return kBits == 8 ? v1::CODEC_INT8 : v1::CODEC_INT4; }

  static size_t BlockBytes(size_t count) {
    return sizeof(float) + (kBits == 8 ? count : (count + 1) / 2);
  }
  size_t EncodedSize(size_t n) const {
    const size_t full = n / block_, rest = n % block_;
    return full * BlockBytes(block_) + (rest ? BlockBytes(rest) : 0);
  }

  absl::Status Encode(const float* values, size_t n, std::string* out) override {
    if (absl::Status s = CheckFiniteInput(values, n); !s.ok()) return s;
    constexpr int kLevels = kBits == 8 ? 127 : 7;
    // Sized once and written in place: the encoding is the payload's bytes.
    const size_t start = out->size();
    out->resize(start + EncodedSize(n));
    char* next = &(*out)[start];
    for (size_t begin = 0; begin < n; begin += block_) {
      const size_t count = std::min(block_, n - begin);
      float absmax = 0;
      for (size_t i = 0; i < count; ++i) absmax = std::max(absmax, std::fabs(values[begin + i]));
      const float scale = absmax / kLevels;
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      std::memcpy(next, &scale, sizeof(scale));
      next += sizeof(scale);
      if (kBits == 8) {
        for (size_t i = 0; i < count; ++i) {
          *next++ = static_cast<char>(static_cast<int8_t>(std::lrintf(values[begin + i] * inverse)));
        }
      } else {
        for (size_t i = 0; i < count; i += 2) {
          const int lo = static_cast<int>(std::lrintf(values[begin + i] * inverse));
          const int hi = i + 1 < count
                             ? static_cast<int>(std::lrintf(values[begin + i + 1] * inverse))
                             : 0;
          *next++ = static_cast<char>((lo & 0x0F) | ((hi & 0x0F) << 4));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Decode(absl::string_view payload, size_t n, float* out) const override {
    if (absl::Status s = CheckDecodeSize(n); !s.ok()) return s;
    const size_t want = EncodedSize(n);
    if (payload.size() != want) {
      return LengthError(kBits == 8 ? "int8" : "int4", payload.size(), want);
    }
    const char* p = payload.data();
    for (size_t begin = 0; begin < n; begin += block_) {
      const size_t count = std::min(block_, n - begin);
      const float scale = Load<float>(p);
      if (!std::isfinite(scale) || scale < 0) {
        return absl::InvalidArgumentError("block scale is negative or not finite");
      }
      p += sizeof(float);
      if (kBits == 8) {
        for (size_t i = 0; i < count; ++i) out[begin + i] = scale * static_cast<int8_t>(p[i]);
        p += count;
      } else {
        for (size_t i = 0; i < count; ++i) {
          const uint8_t byte = static_cast<uint8_t>(p[i / 2]);
          int nibble = (i % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
          if (nibble >= 8) nibble -= 16;  // sign-extend
          out[begin + i] = scale * nibble;
        }
        p += (count + 1) / 2;
      }
    }
    return absl::OkStatus();
  }

 private:
  size_t block_;
};

class TopKCodec : public Codec {
 public:
  TopKCodec(double fraction, bool error_feedback)
      : fraction_(fraction), error_feedback_(error_feedback) {}
  v1::Codec id() const override { return v1::CODEC_TOPK; }

  absl::Status Encode(const float* values, size_t n, std::string* out) override {
    if (absl::Status s = CheckFiniteInput(values, n); !s.ok()) return s;
    std::vector<float> v(values, values + n);
    if (error_feedback_) {
      if (residual_.size() != n) residual_.assign(n, 0.0f);
      for (size_t i = 0; i < n; ++i) v[i] += residual_[i];
    }
    const size_t k = n == 0 ? 0 : std::min<size_t>(n, static_cast<size_t>(std::ceil(fraction_ * n)));
    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::nth_element(order.begin(), order.begin() + k, order.end(), [&](uint32_t a, uint32_t b) {
      return std::fabs(v[a]) > std::fabs(v[b]);
    });
    order.resize(k);
    std::sort(order.begin(), order.end());
    Append(out, static_cast<uint32_t>(k));
    for (uint32_t index : order) {
      Append(out, index);
      Append(out, v[index]);
    }
    if (error_feedback_) {
      residual_ = v;
      for (uint32_t index : order) residual_[index] = 0;
    }
    return absl::OkStatus();
  }

  absl::Status Decode(absl::string_view payload, size_t n, float* out) const override {
    if (absl::Status s = CheckDecodeSize(n); !s.ok()) return s;
    if (payload.size() < sizeof(uint32_t)) return LengthError("topk", payload.size(), 4);
    const uint32_t k = Load<uint32_t>(payload.data());
    if (k > n || payload.size() != sizeof(uint32_t) + size_t{k} * 8) {
      return absl::InvalidArgumentError(absl::StrCat(
          "topk payload of ", payload.size(), " bytes with k=", k, " for ", n, " values"));
    }
    std::fill(out, out + n, 0.0f);
    const char* p = payload.data() + sizeof(uint32_t);
    int64_t previous = -1;
    for (uint32_t j = 0; j < k; ++j, p += 8) {
      const uint32_t index = Load<uint32_t>(p);
      if (index >= n || static_cast<int64_t>(index) <= previous) {
        return absl::InvalidArgumentError(absl::StrCat("topk index ", index, " out of order or range"));
      }
      previous = index;
      out[index] = Load<float>(p + 4);
    }
    return absl::OkStatus();
  }

 private:
  double fraction_;
  bool error_feedback_;
  std::vector<float> residual_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Codec>> MakeCodec(v1::Codec id, const CodecOptions& options) {
  switch (id) {
    case v1::CODEC_NONE:
      return std::unique_ptr<Codec>(new RawCodec());
    case v1::CODEC_FP16:
      return std::unique_ptr<Codec>(new HalfCodec<c10::Half, v1::CODEC_FP16>());
    case v1::CODEC_BF16:
      return std::unique_ptr<Codec>(new HalfCodec<c10::BFloat16, v1::CODEC_BF16>());
    case v1::CODEC_INT8:
    case v1::CODEC_INT4:
      if (options.block_size <= 0 || options.block_size > (1 << 20)) {
        return absl::InvalidArgumentError(absl::StrCat("block size ", options.block_size));
      }
      if (id == v1::CODEC_INT8) return std::unique_ptr<Codec>(new BlockCodec<8>(options.block_size));
      return std::unique_ptr<Codec>(new BlockCodec<4>(options.block_size));
    case v1::CODEC_TOPK:
      if (!(options.topk_fraction > 0 && options.topk_fraction <= 1)) {
        return absl::InvalidArgumentError(absl::StrCat("topk fraction ", options.topk_fraction));
      }
      return std::unique_ptr<Codec>(new TopKCodec(options.topk_fraction, options.error_feedback));
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown codec ", static_cast<int>(id)));
  }
}

absl::Status ZstdCompress(absl::string_view in, int level, std::string* out) {
  const size_t bound = ZSTD_compressBound(in.size());
  const size_t start = out->size();
  out->resize(start + bound);
  const size_t n = ZSTD_compress(out->data() + start, bound, in.data(), in.size(), level);
  if (ZSTD_isError(n)) {
    out->resize(start);
    return absl::InternalError(absl::StrCat("zstd: ", ZSTD_getErrorName(n)));
  }
  out->resize(start + n);
  return absl::OkStatus();
}

absl::Status CheckZstdFrameHeader(absl::string_view frame, uint64_t content_bytes) {
  const unsigned long long size = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (size == ZSTD_CONTENTSIZE_ERROR) {
    return absl::InvalidArgumentError("zstd'd tensor: not a zstd frame");
  }
  if (size == ZSTD_CONTENTSIZE_UNKNOWN) {
    return absl::InvalidArgumentError("zstd'd tensor: the frame does not declare its size");
  }
  if (size != content_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("zstd'd tensor: the frame declares ", size,
                                                   " bytes; the header announces ",
                                                   content_bytes));
  }
  const size_t compressed = ZSTD_findFrameCompressedSize(frame.data(), frame.size());
  if (ZSTD_isError(compressed) || compressed != frame.size()) {
    return absl::InvalidArgumentError(
        "zstd'd tensor: the payload is not exactly one whole zstd frame");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ZstdDecompress(absl::string_view in, size_t max_bytes) {
  const unsigned long long size = ZSTD_getFrameContentSize(in.data(), in.size());
  if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) {
    return absl::InvalidArgumentError("not a zstd frame with a known size");
  }
  if (size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("zstd frame of ", size, " bytes exceeds the ", max_bytes, " announced"));
  }
  std::string out(size, '\0');
  const size_t n = ZSTD_decompress(out.data(), out.size(), in.data(), in.size());
  if (ZSTD_isError(n) || n != size) {
    return absl::InvalidArgumentError(absl::StrCat("corrupt zstd frame: ",
                                                   ZSTD_isError(n) ? ZSTD_getErrorName(n) : "short"));
  }
  return out;
}

}  // namespace geotrain
