#include "common/adaptive_codec.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/codec.h"

namespace geotrain {

double NominalCodecRatio(v1::Codec codec, double topk_fraction) {
  switch (codec) {
    case v1::CODEC_FP16:
    case v1::CODEC_BF16:
      return 0.5;
    case v1::CODEC_INT8:
      return 0.25 + 1.0 / 64;  // a float32 scale per block of 64
    case v1::CODEC_INT4:
      return 0.125 + 1.0 / 64;
    case v1::CODEC_TOPK:
      return 2 * topk_fraction;  // index and value per kept element
    default:
      return 1.0;
  }
}

std::vector<v1::Codec> CodecLadder(v1::Codec strongest) {
  switch (strongest) {
    case v1::CODEC_FP16:
      return {v1::CODEC_NONE, v1::CODEC_FP16};
    case v1::CODEC_BF16:
      return {v1::CODEC_NONE, v1::CODEC_BF16};
    case v1::CODEC_INT8:
      return {v1::CODEC_NONE, v1::CODEC_FP16, v1::CODEC_INT8};
    case v1::CODEC_INT4:
      return {v1::CODEC_NONE, v1::CODEC_FP16, v1::CODEC_INT8, v1::CODEC_INT4};
    case v1::CODEC_TOPK:
      return {v1::CODEC_NONE, v1::CODEC_FP16, v1::CODEC_INT8, v1::CODEC_TOPK};
    default:
      return {v1::CODEC_NONE};
  }
}

v1::Codec CapToLadder(v1::Codec chosen, v1::Codec strongest) {
  if (chosen == v1::CODEC_UNSPECIFIED) return strongest;
  const std::vector<v1::Codec> ladder = CodecLadder(strongest);
  for (v1::Codec c : ladder) {
    if (c == chosen) return c;
  }
  const size_t step = CodecLadder(chosen).size() - 1;
  return ladder[std::min(step, ladder.size() - 1)];
}

AdaptiveCodecSelector::AdaptiveCodecSelector(std::vector<v1::Codec> ladder,
                                             AdaptiveCodecOptions options)
    : ladder_(ladder.empty() ? std::vector<v1::Codec>{v1::CODEC_NONE} : std::move(ladder)),
      options_(options),
      reason_("starting at the weakest codec; no link rate measured yet") {}

bool AdaptiveCodecSelector::Observe(double link_s, double compute_s) {
  if (link_s <= 0 || compute_s <= 0) return false;
  const v1::Codec current = codec();
  const double ratio = link_s / compute_s;
  const bool can_go_up = index_ + 1 < ladder_.size();
  // The wire time the next weaker codec would have.
  const double weaker_ratio =
      index_ > 0 ? ratio * NominalCodecRatio(ladder_[index_ - 1], options_.topk_fraction) /
                       NominalCodecRatio(current, options_.topk_fraction)
                 : 0;
  votes_up_ = can_go_up && ratio > options_.step_up_above ? votes_up_ + 1 : 0;
  votes_down_ = index_ > 0 && weaker_ratio < options_.step_down_below ? votes_down_ + 1 : 0;
  const std::string figures =
      absl::StrFormat("link %.1f ms vs compute %.1f ms per microbatch", link_s * 1e3,
                      compute_s * 1e3);
  if (votes_up_ >= options_.patience) {
    ++index_;
    votes_up_ = votes_down_ = 0;
    reason_ = last_change_ = absl::StrCat("link-bound (", figures, "): ", CodecName(current),
                                          " -> ", CodecName(codec()));
    return true;
  }
  if (votes_down_ >= options_.patience) {
    --index_;
    votes_up_ = votes_down_ = 0;
    reason_ = last_change_ = absl::StrCat("compute-bound (", figures, "): ",
                                          CodecName(current), " -> ", CodecName(codec()));
    return true;
  }
  if (votes_up_ == 0 && votes_down_ == 0) {
    const char* state = ratio > options_.step_up_above ? "link-bound at the strongest allowed codec"
                        : index_ == 0                  ? "compute-bound at the weakest codec"
                                                       : "balanced";
    reason_ = absl::StrCat(state, " (", figures, ")",
                           last_change_.empty() ? "" : "; last change: ", last_change_);
  }
  return false;
}

}  // namespace geotrain
