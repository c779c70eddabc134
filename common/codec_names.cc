// Codec names, torch-free so that the coordinator can parse them.
#include "absl/strings/str_cat.h"
#include "common/codec.h"

namespace geotrain {

absl::StatusOr<v1::Codec> ParseCodecName(const std::string& name) {
  for (v1::Codec id : {v1::CODEC_NONE, v1::CODEC_FP16, v1::CODEC_BF16, v1::CODEC_INT8,
                       v1::CODEC_INT4, v1::CODEC_TOPK}) {
    if (CodecName(id) == name) return id;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown codec '", name, "' (none, fp16, bf16, int8, int4, topk)"));
}

std::string CodecName(v1::Codec id) {
  switch (id) {
    case v1::CODEC_NONE: return "none";
    case v1::CODEC_FP16: return "fp16";
    case v1::CODEC_BF16: return "bf16";
    case v1::CODEC_INT8: return "int8";
    case v1::CODEC_INT4: return "int4";
    case v1::CODEC_TOPK: return "topk";
    default: return absl::StrCat("codec#", static_cast<int>(id));
  }
}

}  // namespace geotrain
