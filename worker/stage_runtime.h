// The compute layer of one pipeline stage: owns the stage's layers, its
// versioned weights (WeightStash) and an out-of-place optimizer, runs forward
// and backward for microbatches given as LinkMessages, and keeps each training
// microbatch's autograd graph, and the weight version it used, until its
// backward. The backward differentiates with respect to exactly that version
// (torch::autograd::grad, per microbatch) and checks that nothing modified it.
// Every LibTorch exception is caught here and returned as a Status; this
// header does not include LibTorch.
//
// Not thread-safe: one thread (the pipeline driver) calls it.
#ifndef GEOTRAIN_WORKER_STAGE_RUNTIME_H_
#define GEOTRAIN_WORKER_STAGE_RUNTIME_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/link_message.h"
#include "common/tensor_wire.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"
#include "geotrain/v1/stage.pb.h"

namespace geotrain {

struct PseudoGradientContribution;  // worker/outer_optimizer.h
class ErrorFeedbackEncoder;         // worker/outer_optimizer.h

struct StagePlacement {
  int stage = 0;
  int num_stages = 1;
  int layer_begin = 0;
  int layer_end = 0;
};

struct RuntimeOptions {
  std::string device = "cpu";  // "cpu", "cuda", "cuda:N" (already resolved)
  // Most weight versions that may be alive at once (0: no limit). Exceeding
  // it is an internal error: the schedule broke its own guarantee.
  int max_weight_versions = 0;
  // How outgoing activations and gradients are encoded on the wire.
  WireEncoding activation_encoding;
  WireEncoding gradient_encoding;
  // For tests only (an adversarial worker, WorkerOptions::tamper_runtime):
  // after `tamper_after_forwards` forward passes, every pass leaves out the
  // stage's layer of this index (0: its first), as faulty or lazy
  // hardware might. Its outputs stay true to nothing: a spot check's
  // recomputation runs every layer. -1: never.
  int tamper_skip_layer = -1;
  int64_t tamper_after_forwards = 0;
  // For tests only, as above: after this many updates, each update drops
  // its gradients and publishes the weights unchanged as the next version
  // (a stage that skips its updates and trains on stale weights; its
  // optimizer state stays where it was). -1: never. With
  // `tamper_claim_syncs` each skipped update publishes the weights twice and
  // counts the second as a weight sync (weight_syncs()), as if an outer step
  // came between: a skipper dodging its update audits.
  int64_t tamper_skip_updates_after = -1;
  bool tamper_claim_syncs = false;
};

// Weight stashing figures of one stage.
struct StashStats {
  int64_t current_version = 0;
  int versions_alive = 0;
  int max_versions_alive = 0;
  uint64_t bytes_alive = 0;
  int64_t references = 0;          // in-flight microbatches holding a version
  int64_t staleness_max = 0;       // updates between a forward and its backward
  double staleness_mean = 0;
  int64_t backwards_checked = 0;   // backwards whose weight version was verified
};

struct LastStageResult {
  double loss = 0;
  std::optional<LinkMessage> gradient;  // for upstream; none on stage 0
};

struct EvalResult {
  double loss = 0;        // mean over every element evaluated
  double accuracy = -1;   // classifiers only, else -1
  int64_t samples = 0;
};

class StageRuntime {
 public:
  static absl::StatusOr<std::unique_ptr<StageRuntime>> Create(
      const v1::JobSpec& job, const StagePlacement& placement,
      const RuntimeOptions& options);
  ~StageRuntime();

  bool is_first() const;
  bool is_last() const;

  // Stage 0 only: microbatch `index` of step `step` (training), or held-out
  // microbatch `index`, as an input message of tensors [inputs, targets].
  absl::StatusOr<LinkMessage> LoadTrainMicrobatch(int step, int index);
  // Training microbatch `microbatch` of this pipeline, labelled with `step`
  // and that id; its data is the dataset's index DataIndexOf(microbatch),
  // a function of (seed, index) alone. LoadTrainMicrobatch(step, i) is
  // microbatch step * m + i (m: SetDataShard's microbatches a step).
  absl::StatusOr<LinkMessage> LoadTrainMicrobatchById(int step, int64_t microbatch);
  // Pipeline `pipeline` of `pipelines` from step `start_step`, whose first
  // microbatch is data index `base`, running `microbatches` (m) a step
  // whose indices span `block` (B): microbatch id l (of step s = l / m) is
  // index base + (s - start_step) * B + (l % m) * R + pipeline, so the
  // pipelines draw disjoint indices and together every one. B is R x m,
  // or the job's M when the pipelines split it (OuterOptimizer.split_batch;
  // m is then this lane's share). 0 for either: the job's M and R x M.
  // The default (one pipeline from step 0, base 0) is the identity.
  void SetDataShard(int pipelines, int pipeline, int start_step, int64_t base,
                    int microbatches = 0, int64_t block = 0);
  int64_t DataIndexOf(int64_t microbatch) const;
  // The data indices of the training microbatches drawn since the last
  // SetDataShard: from `first` to `last` every `stride` (a pipeline's
  // consecutive microbatches draw every stride-th index), `per_block` of
  // each `block` indices where a step's share is not all of its block (an
  // uneven split; 0 otherwise). None: none drawn.
  struct DataDrawn {
    int64_t first = 0, last = 0;
    int stride = 1;
    int per_block = 0;
    int64_t block = 0;
  };
  std::optional<DataDrawn> data_drawn() const;
  absl::StatusOr<LinkMessage> LoadEvalMicrobatch(int index);
  int num_eval_microbatches() const;

  // Non-last stages. For ACTIVATION input, runs forward and keeps the graph
  // until Backward() for the same microbatch; for EVAL input, forward only.
  // Returns the message for downstream (activation + targets).
  absl::StatusOr<LinkMessage> Forward(const LinkMessage& input);
  // Non-last stages: backward of the microbatch named by `gradient`, whose
  // single tensor is d(loss)/d(our output). Returns the gradient for
  // upstream, or nullopt on stage 0.
  absl::StatusOr<std::optional<LinkMessage>> Backward(const LinkMessage& gradient);

  // Last stage, training: forward, loss, backward (gradients accumulate).
  absl::StatusOr<LastStageResult> ForwardLoss(const LinkMessage& input);
  // Last stage, for a verifier: how far the rounding of the loss's softmax
  // alone may move the gradient ForwardLoss sends for `input`. For a
  // confidently classified sample p - 1 at the true class is a difference
  // of numbers near 1, so its absolute error is a few units in the last
  // place of 1.0 whatever the sample, and two builds (another exp) round it
  // differently. Returns, per element of the input, |d(mean of the true
  // classes' logits)/d(input)| times `ulps` units of 2^-24, as a GRADIENT
  // message of one raw float32 tensor. Nothing accumulates; no weight
  // version is held.
  absl::StatusOr<LinkMessage> LossRoundingFloor(const LinkMessage& input, double ulps);
  // Last stage, evaluation: accumulates loss (and accuracy) of `input`
  // into the pass of its header's step (passes may overlap when one is held
  // up on a paused replica).
  absl::Status EvalForward(const LinkMessage& input);
  // The pass of evaluation step `step`, forgotten once taken (its one
  // synchronisation on a GPU; samples 0 if a decoded input failed a check).
  EvalResult TakeEvalResult(int step);

  // Optimizer step with the mean of the gradients accumulated since the last
  // one; publishes a new weight version. No-op without gradients.
  // `progress` (fraction of the run's samples seen) drives the job's
  // learning-rate schedule.
  //
  // Tied embeddings: a stage holding the embedding or the head (not both)
  // passes `exchange_tied`, which trades this stage's gradient sum of the
  // tied matrix (float32 bytes) for the other end's; both then step with
  // their sum. A stage holding both adds them itself.
  using TiedGradientExchangeFn =
      std::function<absl::StatusOr<std::string>(std::string_view mine)>;
  absl::Status ApplyUpdate(double progress = 0, const TiedGradientExchangeFn& exchange_tied = {});
  // Whether this stage holds one end of a tied embedding that another stage
  // holds the other end of (it must then exchange at each update).
  bool holds_one_tied_end() const;
  // Bytes of the tied matrix, float32 [vocab, d_model]; 0 without tying.
  static uint64_t TiedEmbeddingBytes(const v1::JobSpec& job);
  StashStats stash_stats() const;

  // The version new forwards use (the weight stash's current one).
  int64_t current_weight_version() const;

  // This stage's layers (current weights and optimizer state) as one
  // checkpoint per layer, labelled `step`. `weights_only`: no optimizer or
  // outer state (what a spot check recomputes with).
  absl::StatusOr<std::vector<v1::LayerCheckpoint>> ExportCheckpoint(
      int step, bool weights_only = false) const;
  // The current version's weights as ExportCheckpoint(0, true) gives them,
  // exported only when called, on any thread. Nothing is copied now: it
  // holds the version's tensors, which the stash never changes once
  // published (each update publishes new ones). What audits keep for every
  // version and export for the few they draw. `with_optimizer_state`: the
  // optimizer's state now too (what an update audit restores before it
  // replays the update), held the same way.
  using WeightsExport = std::function<absl::StatusOr<std::vector<v1::LayerCheckpoint>>()>;
  WeightsExport ExportWeightsLater(bool with_optimizer_state = false) const;
  // Bytes of the current version's weights, and of the optimizer's state.
  uint64_t WeightBytes() const;
  uint64_t OptimizerStateBytes() const;
  // The same layers as LayerStateChunks (common/layer_state.h) read
  // straight from the live tensors, a chunk at a time: no copy of the stage
  // is made, so the stage must not change meanwhile (call it from the
  // driver's thread, between updates). CANCELLED when `emit` returns false.
  absl::Status StreamCheckpoint(
      int step, const std::function<bool(const v1::LayerStateChunk&)>& emit) const;
  // Bytes of weights and optimizer state this stage holds (what a
  // checkpoint of it carries).
  uint64_t StateBytes() const;
  // Loads checkpoints of any of this stage's layers (the others keep their
  // weights; optimizer state missing for some starts from zero) and
  // publishes them as a new weight version. REQUIRES: nothing in flight
  // (DropInFlight()). INVALID_ARGUMENT when a tensor does not fit the model.
  absl::Status RestoreCheckpoint(const std::vector<v1::LayerCheckpoint>& layers);
  // Forgets the optimizer's state and step count, so that the next
  // RestoreCheckpoint sets them exactly (it keeps the larger step count):
  // a verifier replays one update from the state a checkpoint holds.
  absl::Status ResetOptimizer();
  // Replicas: this stage's current weights, one entry per layer, encoded
  // with `encoding` (for ReplicaAverager).
  absl::StatusOr<std::vector<v1::LayerWeights>> ExportWeights(const WireEncoding& encoding) const;
  // Replicas: averages the weights of each layer named in `peers` (several
  // entries may name one layer, from different replicas) with this stage's
  // current ones, w = (w + sum of the peers' w) / (1 + their number), or
  // with `adopt` takes the peers' mean instead of its own, and publishes the
  // result as a new weight version (stashed versions of microbatches in
  // flight are untouched). Optimizer state is kept. On INVALID_ARGUMENT (an
  // entry does not fit the model, or decodes to non-finite values) nothing
  // changes.
  absl::Status AverageWeights(const std::vector<v1::LayerWeights>& peers, bool adopt = false);
  // ---- The outer optimizer (outer_optimizer.h): this stage's replicas in
  // other pipelines take the same outer step every round.
  struct OuterSettings {
    double lr = 0.7;
    double momentum = 0.9;
    // The pseudo-gradients' encoding on the wire (lossy codecs with error
    // feedback).
    WireEncoding encoding;
  };
  // Takes the current weights as the outer weights, momentum zero (a run's
  // start, or a replica that takes the outer weights on its return); or,
  // after RestoreCheckpoint of a checkpoint that held them, the outer
  // weights, momentum and rounds it held.
  absl::Status StartOuter(const OuterSettings& settings);
  bool outer_started() const;
  // This replica's pseudo-gradient since the last outer step (outer minus
  // current weights), encoded, one entry per layer; remembers the weights
  // it was taken from.
  absl::StatusOr<std::vector<v1::LayerWeights>> ExportPseudoGradient();
  struct OuterContribution {
    int pipeline = 0;     // the order of the sum, the same on every replica
    int64_t samples = 0;  // its weight in the mean
    std::vector<v1::LayerWeights> layers;  // as ExportPseudoGradient wrote
  };
  // The outer step on the samples-weighted mean of `contributions` (this
  // replica's own included, as encoded, so every replica computes from the
  // same bytes). The new outer weights become this stage's weights (a new
  // weight version; the inner optimizer's state is kept). With
  // `keep_local_progress` (the step applied a round late, while inner steps
  // went on) the inner steps taken since ExportPseudoGradient are added on
  // top. INVALID_ARGUMENT (nothing changes) for a contribution that does
  // not fit or is not finite.
  absl::Status ApplyOuterStep(const std::vector<OuterContribution>& contributions,
                              bool keep_local_progress = false);
  // The same in two halves, for a stage whose replicas sync through a
  // reducer (outer_sync.h): the reducer's samples-weighted mean of the
  // contributions, encoded with the outer codec (error feedback of its
  // own); and the outer step on such a mean, as every replica received it.
  absl::StatusOr<std::vector<v1::LayerWeights>> ReduceOuterContributions(
      const std::vector<OuterContribution>& contributions);
  absl::Status ApplyOuterMean(const std::vector<v1::LayerWeights>& mean,
                              bool keep_local_progress = false);
  int64_t outer_rounds() const;
  // The outer state for replicas that must take it (outer_sync.h,
  // share_state): the outer weights, one entry per layer, then the outer
  // momentum, again per layer, once a step has made one; lossless.
  absl::StatusOr<std::vector<v1::LayerWeights>> ExportOuterState();
  // Takes another replica's outer state (as ExportOuterState wrote it) and
  // `rounds`; the current weights become its outer weights plus the inner
  // steps taken since this replica's own outer weights. INVALID_ARGUMENT
  // (nothing changes) for a state that does not fit or is not finite.
  absl::Status AdoptOuterState(const std::vector<v1::LayerWeights>& state, int64_t rounds);
  // SHA-256 (hex) of the current weights' bytes, in parameter order: equal
  // digests mean bit-identical weights.
  std::string WeightsDigest() const;
  // The same of the outer weights ("" before StartOuter).
  std::string OuterWeightsDigest() const;
  // SHA-256 (hex) of the optimizer's state now (State()'s tensors' bytes,
  // per parameter in order) and its step count as a 64-bit little-endian
  // integer: equal digests mean the same next update from the same
  // gradients. What an update audit holds a stage's state to.
  std::string OptimizerStateDigest() const;
  // How many weight versions came from something other than this stage's
  // optimizer updates (RestoreCheckpoint, AverageWeights, an outer step).
  int64_t weight_syncs() const;

  // Forgets every training microbatch in flight (their graphs and stashed
  // weight references are freed), the gradients accumulated since the last
  // update and unfinished evaluation passes; returns how many training
  // microbatches were dropped.
  int DropInFlight();
  int layer_begin() const;
  int layer_end() const;
  const StagePlacement& placement() const;

  // The most weight versions alive at once from now on (the plan's
  // schedule; a runtime kept across a re-plan takes the new plan's).
  void SetMaxWeightVersions(int versions);

  // Changes the codec of outgoing activations or gradients from the next
  // message on (adaptive compression); receivers read it from each header.
  void SetActivationCodec(v1::Codec codec);
  void SetGradientCodec(v1::Codec codec);

  // Training microbatches whose forward ran and whose backward has not.
  size_t pending_microbatches() const;
  std::string device() const;

 private:
  struct Impl;
  explicit StageRuntime(std::unique_ptr<Impl> impl);
  // The outer step's helpers.
  absl::StatusOr<std::vector<at::Tensor>> DecodeStageTensors(
      const std::vector<v1::LayerWeights>& layers, const char* what) const;
  absl::Status PublishOuterWeights(const std::vector<at::Tensor>& outer, bool keep_local_progress);
  // One entry per layer of this stage, each parameter through `encoder`.
  absl::StatusOr<std::vector<v1::LayerWeights>> EncodeStageTensors(
      const std::vector<at::Tensor>& tensors, ErrorFeedbackEncoder* encoder) const;
  absl::StatusOr<std::vector<PseudoGradientContribution>> DecodeContributions(
      const std::vector<OuterContribution>& contributions) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_STAGE_RUNTIME_H_
