// The outer step of DiLoCo, between the replicas of one stage (the same
// stage in R pipelines). A round starts with every replica on the same
// outer weights θ; each runs H inner steps with its own optimizer to θ_r.
// The round's pseudo-gradient is the samples-weighted mean
//   Δ = Σ_r n_r (θ − θ_r) / Σ_r n_r
// over the replicas present, and the outer step is Nesterov momentum,
// exactly as torch.optim.SGD(lr, momentum, nesterov=True) with grad Δ:
//   b ← μ b + Δ (b = Δ on the first step);  θ ← θ − lr (Δ + μ b).
// With lr 1 and μ 0 the new θ is the replicas' weighted mean.
//
// Every replica must reach bit-identical weights: each decodes every
// contribution, its own included, from the same encoded bytes, and sums
// them in one fixed order (PseudoGradientContribution::pipeline), in
// float32 on the CPU.
//
// A compute unit (LibTorch). Not thread-safe.
#ifndef GEOTRAIN_WORKER_OUTER_OPTIMIZER_H_
#define GEOTRAIN_WORKER_OUTER_OPTIMIZER_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tensor_wire.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

struct OuterStepOptions {
  double lr = 0.7;
  double momentum = 0.9;
  bool nesterov = true;
};

// One replica's pseudo-gradient for a round, decoded.
struct PseudoGradientContribution {
  int pipeline = 0;     // the order of the sum
  int64_t samples = 0;  // its weight; 0 contributes nothing
  std::vector<torch::Tensor> tensors;
};

class OuterOptimizer {
 public:
  explicit OuterOptimizer(OuterStepOptions options);

  // Starts a run from `params` (copied, float32 CPU): the outer weights,
  // momentum zero.
  void Reset(const std::vector<torch::Tensor>& params);
  bool started() const { return !outer_.empty(); }

  // θ − θ_r for this replica's weights `params`. REQUIRES: started().
  absl::StatusOr<std::vector<torch::Tensor>> PseudoGradient(
      const std::vector<torch::Tensor>& params) const;

  // The weighted mean of `contributions` (summed in pipeline order), then
  // the outer step. Returns the new outer weights (also kept). A round
  // without samples leaves θ as it is. INVALID_ARGUMENT when a contribution
  // does not fit the weights or is not finite (nothing changes then).
  absl::StatusOr<std::vector<torch::Tensor>> Step(
      std::vector<PseudoGradientContribution> contributions);
  // The two halves of Step: the samples-weighted mean (empty when no
  // contribution has samples), and the outer step on a mean (a reducer's,
  // as every replica received it).
  absl::StatusOr<std::vector<torch::Tensor>> Mean(
      std::vector<PseudoGradientContribution> contributions) const;
  absl::StatusOr<std::vector<torch::Tensor>> StepWithMean(const std::vector<torch::Tensor>& mean);

  const std::vector<torch::Tensor>& outer_weights() const { return outer_; }
  // Empty before the first Step().
  const std::vector<torch::Tensor>& momentum() const { return momentum_; }
  int64_t rounds() const { return rounds_; }
  // For checkpoints: the outer weights and momentum as saved, and the
  // number of outer steps taken. INVALID_ARGUMENT when shapes differ.
  absl::Status Restore(const std::vector<torch::Tensor>& outer,
                       const std::vector<torch::Tensor>& momentum, int64_t rounds);

 private:
  absl::Status CheckFits(const std::vector<torch::Tensor>& tensors, const char* what) const;

  const OuterStepOptions options_;
  std::vector<torch::Tensor> outer_;
  std::vector<torch::Tensor> momentum_;
  int64_t rounds_ = 0;
};

// Encodes one replica's pseudo-gradients on the wire (common/tensor_wire.h)
// with error feedback for the lossy codecs: what the codec lost from a
// tensor in one round is added to the same tensor in the next, so nothing
// is lost for good. One per replica and stage, kept across rounds.
class ErrorFeedbackEncoder {
 public:
  explicit ErrorFeedbackEncoder(WireEncoding encoding) : encoding_(encoding) {}
  // Appends tensor `index` (plus its residual) to `payload`, described in
  // `header`, and keeps what the encoding lost of it.
  absl::Status Encode(size_t index, const torch::Tensor& tensor, v1::TensorHeader* header,
                      std::string* payload);
  // What tensor `index` carries into the next round (undefined before).
  torch::Tensor residual(size_t index) const;
  const WireEncoding& encoding() const { return encoding_; }

 private:
  const WireEncoding encoding_;
  std::vector<torch::Tensor> residual_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_OUTER_OPTIMIZER_H_
