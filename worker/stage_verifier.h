// A spot check's recomputation (docs/verification.md): a scratch copy of a
// stage that loads the audited stage's weights, recomputes one committed
// output from the logged input, and compares the two (worker/output_check.h).
//
// What it checks before it computes anything:
// - the weights are the ones the audited stage committed to: their digest
//   (StageRuntime::WeightsDigest) equals the claim's
//   LinkHeader.weights_digest, which the claim's commitment covers and its
//   receiver logged before any audit was drawn. Weights that do not hash to
//   it, or a claim that commits to none, fail the audit: the audited worker
//   alone chose them;
// - the logged input and, for a gradient, the downstream neighbour's
//   logged gradient carry valid commitments (common/commitment.h), so a
//   neighbour's log cannot be swapped for other bytes;
// - the claim's own commitment holds, and the input, the claim and the
//   gradient name the same plan epoch and microbatch.
// A failed precondition is an error naming it (the evidence does not hold
// together); a recomputation that differs is a failed OutputComparison.
//
// The verifier never updates its weights and keeps nothing between audits.
// Not thread-safe: one audit at a time.
#ifndef GEOTRAIN_WORKER_STAGE_VERIFIER_H_
#define GEOTRAIN_WORKER_STAGE_VERIFIER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/link_message.h"
#include "geotrain/v1/coordinator.pb.h"
#include "worker/output_check.h"
#include "worker/stage_runtime.h"

namespace geotrain {

// One committed computation of a stage, with its evidence.
struct AuditedComputation {
  // The audited stage's weights at the version the claim was computed with
  // (they must hash to the claim's weights_digest).
  std::vector<v1::LayerCheckpoint> weights;
  // What the stage received: the upstream neighbour's logged activation,
  // or, on stage 0, the microbatch the verifier loads from (seed, id).
  LinkMessage input;
  // For a GRADIENT claim below the last stage: the downstream neighbour's
  // logged gradient of the stage's output.
  std::optional<LinkMessage> output_gradient;
  // The audited output as committed: an ACTIVATION, or a GRADIENT for the
  // upstream neighbour.
  LinkMessage claim;
  // Where the audited stage computed ("cpu", "cuda:0"): the tolerance's
  // device term.
  std::string audited_device = "cpu";
};

// One optimizer update of a stage, with its evidence (an update audit: the
// check that catches a stage that skips its updates and computes on stale
// weights, which an output audit cannot, since its outputs are true to the
// weights it holds).
struct AuditedUpdate {
  // The weights and optimizer state before the update, and their digest.
  std::vector<v1::LayerCheckpoint> before;
  std::string before_digest;
  // During a job: the stage's committed outputs of the step and of the
  // next one. Their commitments are checked, and their weights digests
  // (LinkHeader.weights_digest) are the digests before and after, and
  // their state digests those of the optimizer state before and after;
  // the weight versions they name must be one update apart, apart from the
  // weight syncs they count (the same version: no update was made, a
  // failed verdict; a jump the syncs do not explain: failed; syncs
  // between, an outer step or replica averaging: the update cannot be
  // recomputed alone, unverifiable).
  std::optional<LinkMessage> before_claim, after_claim;
  // Every microbatch the update summed, in the order the stage computed
  // them: the logged input and, below the last stage, the downstream
  // neighbour's logged gradient.
  struct Microbatch {
    LinkMessage input;
    std::optional<LinkMessage> output_gradient;
  };
  std::vector<Microbatch> microbatches;
  double progress = 0;  // the update's learning-rate position (ApplyUpdate)
  // The weights the stage claims after it, and their digest.
  std::vector<v1::LayerCheckpoint> after;
  std::string after_digest;
  std::string audited_device = "cpu";  // the tolerance's device term
};

// A pipeline's share of the data (StageRuntime::SetDataShard's figures).
struct DataShard {
  int pipelines = 1;
  int pipeline = 0;
  int start_step = 0;
  int64_t base = 0;
  int microbatches = 0;
  int64_t block = 0;
};

struct StageVerifierOptions {
  std::string device = "cpu";
  // Violations allowed (OutputTolerance); the device term comes from
  // DeviceTolerance() for the two devices.
  double max_violation_fraction = 1e-3;
};

class StageVerifier {
 public:
  static absl::StatusOr<std::unique_ptr<StageVerifier>> Create(
      const v1::JobSpec& job, const StagePlacement& placement,
      const StageVerifierOptions& options = {});

  // FAILED_PRECONDITION when the evidence does not hold together (see the
  // file comment), INVALID_ARGUMENT when the claim cannot be recomputed by
  // this stage (an activation from the last stage, a gradient from stage 0).
  absl::StatusOr<OutputComparison> Verify(const AuditedComputation& audit);

  // Stage 0: the input of training microbatch `microbatch` (labelled
  // `step`) of the pipeline whose share of the data is `shard`, loaded as
  // the audited stage loaded it: a function of the job's seed and the
  // index alone. FAILED_PRECONDITION on another stage.
  absl::StatusOr<LinkMessage> LoadFirstStageInput(const DataShard& shard, int step,
                                                  uint64_t microbatch);

  // Recomputes the update from `before` on the microbatches' gradients and
  // compares the result with `after` (CompareUpdates). Weights that do not
  // hash to their digests fail the audit (the audited worker alone supplied
  // them). FAILED_PRECONDITION when a logged message's commitment does not
  // hold;
  // UNIMPLEMENTED for a stage that holds one end of a tied embedding (its
  // update needs the other end's gradient).
  absl::StatusOr<OutputComparison> VerifyUpdate(const AuditedUpdate& audit);

 private:
  StageVerifier(const v1::JobSpec& job, const StagePlacement& placement,
                RuntimeOptions runtime_options, StageVerifierOptions options)
      : job_(job),
        placement_(placement),
        runtime_options_(std::move(runtime_options)),
        options_(std::move(options)) {}

  // Makes the copy of the stage (once: an update audit resets only its
  // optimizer, StageRuntime::ResetOptimizer).
  absl::Status Reset();

  absl::StatusOr<LinkMessage> Recompute(const AuditedComputation& audit);
  // The recomputation from the audit's input moved by +- kNearbyInput of
  // its RMS (a fixed pattern of signs), for CompareOutputs' `nearby`; none
  // when the input is not float32 (stage 0's tokens or pixels are exact).
  absl::StatusOr<std::vector<LinkMessage>> RecomputeNearby(const AuditedComputation& audit);
  // A failed comparison for weights that are not the committed ones.
  static OutputComparison WrongWeights(const std::string& why);
  // Restores `weights` and checks they hash to `digest`.
  absl::Status Load(const std::vector<v1::LayerCheckpoint>& weights, const std::string& digest,
                    const char* what);
  // Forward and backward of one microbatch (the last stage: with its loss);
  // the weights' gradient accumulates. Returns the gradient for upstream
  // (none on stage 0).
  absl::StatusOr<std::optional<LinkMessage>> ForwardBackward(
      const LinkMessage& input, const std::optional<LinkMessage>& output_gradient);
  absl::Status Accumulate(const AuditedUpdate::Microbatch& microbatch);

  const v1::JobSpec job_;
  const StagePlacement placement_;
  const RuntimeOptions runtime_options_;
  const StageVerifierOptions options_;
  std::unique_ptr<StageRuntime> runtime_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_STAGE_VERIFIER_H_
