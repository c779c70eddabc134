// The comparison at the heart of a spot check (docs/verification.md): a
// stage's committed output against a verifier's own recomputation of it.
//
// Honest results differ: the sender's codec rounds, and two devices (BLAS
// kernels, CPU against GPU) sum in different orders. So every element of a
// float tensor gets a bound, derived from the codec the claim was encoded
// with and from the two devices, and an element outside it is a violation:
//
//   |claimed_i - recomputed_i| <= codec_i + device * max(absmax(block of i),
//                                                         rms(tensor))
//
//   codec_i: none 0; fp16 2^-11 |r_i| (and saturation past 65504);
//            bf16 2^-8 |r_i|; int8 absmax/254 and int4 absmax/14 of the
//            claim's block of r. topk with error feedback cannot be
//            recomputed (its residual is the sender's): unverifiable.
//   device:  relative to the block's largest magnitude (see
//            DeviceTolerance).
//
// Other tensors (token ids, targets) must be equal. The claim passes when
// its violations are at most `max_violation_fraction` of its elements.
// Torch is used only in the .cc.
#ifndef GEOTRAIN_WORKER_OUTPUT_CHECK_H_
#define GEOTRAIN_WORKER_OUTPUT_CHECK_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/link_message.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct OutputTolerance {
  // Slack for the two devices, relative to each block's largest magnitude
  // (at least the tensor's RMS).
  double device = 1e-3;
  // Violations allowed, as a fraction of the elements compared.
  double max_violation_fraction = 1e-3;
};

// The device term for an audited stage and its verifier ("cpu", "cuda",
// "cuda:N"): 1e-3 between CPUs, whatever their BLAS library and kernels
// (two LibTorch builds, MKL against OpenBLAS, reached 1.07e-4 of the
// tensor's RMS in 13,000 audits of an MLP's gradients); 2e-2 when
// either is a GPU (TF32 matrix products round to 10 bits, and the error
// compounds through the stage's layers).
double DeviceTolerance(const std::string& audited_device, const std::string& verifier_device);

struct OutputComparison {
  bool verifiable = true;  // false: no recomputation can check this codec
  std::string unverifiable_reason;
  // Set when the claim's form differs (tensor count, shape or dtype): a
  // failed comparison with no numbers.
  std::string mismatch;
  // Set when the audit failed before any comparison (the weights supplied
  // are not the committed ones): the reason, whole.
  std::string failure;
  int64_t elements = 0;
  int64_t violations = 0;
  // Float tensors of two dimensions or more, by their leading dimension
  // (a microbatch's samples): rows, and rows with an element outside.
  int64_t rows = 0;
  int64_t rows_outside = 0;
  // ||claimed - recomputed|| / ||recomputed|| over the float tensors.
  double relative_distance = 0;
  // The largest |claimed_i - recomputed_i| / bound_i (1 is the bound).
  double worst_ratio = 0;
  bool passed = false;
  // The bound was widened by a RoundingAllowance (CompareOutputs).
  bool widened = false;

  // One line for events and logs.
  std::string Summary() const;
};

// What a verifier adds to the bound before it fails a claim, where its
// own float32 rounding is not the audited build's:
// - `nearby`: its recomputations from inputs a little off the logged one
//   (StageVerifier: the input +- 1e-5 of its RMS). Each float element's
//   bound grows by twice what each moves it. Where the result is smooth
//   that is about 2e-5 of its scale, far within the device term; at a
//   rounding-sensitive point, a ReLU unit whose preactivation is within
//   rounding of zero, one of them flips the unit as another build's
//   rounding may have, and the bound covers that sample's whole change.
// - `floor`: per element of the first tensor, added as is: the last
//   stage's loss rounding (StageRuntime::LossRoundingFloor).
struct RoundingAllowance {
  std::vector<LinkMessage> nearby;
  std::optional<LinkMessage> floor;
};

// Compares `claimed` (as committed; any codec) with `recomputed` (the
// verifier's result, float32 tensors unencoded), with `allowance` added to
// the bound. INVALID_ARGUMENT when `recomputed` is not raw float32 or
// either message is malformed; a difference in tensor count, shape or
// dtype is a failed comparison, not an error.
absl::StatusOr<OutputComparison> CompareOutputs(const LinkMessage& claimed,
                                                const LinkMessage& recomputed,
                                                const OutputTolerance& tolerance,
                                                const RoundingAllowance& allowance = {});

// An update audit: the weights a stage claims after one optimizer update,
// against a verifier's own update from the same weights and optimizer state
// before it, on the same gradients. Each element of the update
// (after - before) may differ from the recomputed one by
// `update_fraction` of its block's largest recomputed update, plus the
// device term of the weights' block. Where the recomputation has
// optimizer state, the claimed state after is held to it by the same rule
// (its change since the state before), with `state` of its block's
// largest magnitude in place of the device term. A stage that skipped its update
// (stale weights) misses by the whole update.
struct UpdateTolerance {
  double update_fraction = 0.1;
  double device = 1e-4;
  // The optimizer state's own slack, relative to its block's largest
  // magnitude: a running average of gradients, which one sample's ReLU unit
  // rounded either way, or a confident sample's loss, moves by a sliver of
  // its size (measured across the two LibTorch builds: an update audit of
  // stage 0 failed at 8.6x a bound without it, 748 of 150,720 elements,
  // one unit's row). Moments made up to cancel an update are off by
  // multiples.
  double state = 1e-2;
  double max_violation_fraction = 1e-3;
};

// The layers must be the same, in the same order, with the same
// parameters (a difference is a failed comparison); INVALID_ARGUMENT when a
// checkpoint is malformed.
absl::StatusOr<OutputComparison> CompareUpdates(
    const std::vector<v1::LayerCheckpoint>& before,
    const std::vector<v1::LayerCheckpoint>& claimed_after,
    const std::vector<v1::LayerCheckpoint>& recomputed_after, const UpdateTolerance& tolerance);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_OUTPUT_CHECK_H_
