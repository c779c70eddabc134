// Chooses a link's codec from what limits it: while the wire time of a
// microbatch's message exceeds the stage's compute time per microbatch,
// sending is the bottleneck and the next stronger codec of the ladder is
// used; when even the next weaker codec would keep the wire time well under
// the compute time, it steps back. Hysteresis: a step needs `patience`
// consecutive agreeing observations, and the thresholds leave a dead band
// (up above 1.0x compute, down only below 0.5x).
//
// Torch-free and clock-free; not thread-safe (the pipeline driver owns it).
#ifndef GEOTRAIN_COMMON_ADAPTIVE_CODEC_H_
#define GEOTRAIN_COMMON_ADAPTIVE_CODEC_H_

#include <string>
#include <vector>

#include "geotrain/v1/tensor.pb.h"

namespace geotrain {

// Bytes a codec sends per float32 byte, nominally (int8: 1/4 plus a scale
// per block of 64); used to predict the wire time of another codec.
double NominalCodecRatio(v1::Codec codec, double topk_fraction = 0.01);

// none -> fp16 (bf16 if that is the cap) -> int8 -> int4 (topk if that is
// the cap), ending at `strongest`. {none} for none.
std::vector<v1::Codec> CodecLadder(v1::Codec strongest);

// `chosen`'s step on the ladder (none 0, fp16/bf16 1, int8 2, int4/topk
// 3), taken on `strongest`'s ladder: `chosen` itself when that ladder has
// it, else the entry at the same step or the strongest below it.
// UNSPECIFIED: `strongest`.
v1::Codec CapToLadder(v1::Codec chosen, v1::Codec strongest);

struct AdaptiveCodecOptions {
  double step_up_above = 1.0;   // link time / compute time
  double step_down_below = 0.5;
  int patience = 3;
  double topk_fraction = 0.01;
};

class AdaptiveCodecSelector {
 public:
  AdaptiveCodecSelector(std::vector<v1::Codec> ladder, AdaptiveCodecOptions options = {});

  // One observation: the wire time of a microbatch's message at the current
  // codec and the stage's compute time per microbatch, in seconds. Returns
  // true when the codec changed. Observations with a non-positive figure
  // (nothing measured yet) are ignored.
  bool Observe(double link_s, double compute_s);

  v1::Codec codec() const { return ladder_[index_]; }
  // Why the codec is what it is: the last change's cause when it just
  // changed; otherwise the current state, followed by the last change.
  const std::string& reason() const { return reason_; }

 private:
  std::vector<v1::Codec> ladder_;
  AdaptiveCodecOptions options_;
  size_t index_ = 0;
  int votes_up_ = 0, votes_down_ = 0;
  std::string reason_;
  std::string last_change_;  // empty until the first change
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_ADAPTIVE_CODEC_H_
