#include "worker/stage_verifier.h"

#include <torch/torch.h>

#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/commitment.h"
#include "common/status_macros.h"
#include "common/tensor_wire.h"

namespace geotrain {
namespace {

absl::Status CheckEvidence(const LinkMessage& message, const char* what) {
  if (!IsCommittedKind(message.header.kind()) || message.header.commitment().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, " carries no commitment"));
  }
  if (absl::Status committed = CheckCommitment(message.header, message.payload);
      !committed.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": ", committed.message()));
  }
  return absl::OkStatus();
}

absl::Status CheckSameMicrobatch(const LinkMessage& message, const LinkMessage& claim,
                                 const char* what) {
  if (message.header.epoch() != claim.header.epoch() ||
      message.header.microbatch() != claim.header.microbatch()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " is microbatch ", message.header.microbatch(), " of epoch ",
        message.header.epoch(), ", the claim microbatch ", claim.header.microbatch(),
        " of epoch ", claim.header.epoch()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StageVerifier>> StageVerifier::Create(
    const v1::JobSpec& job, const StagePlacement& placement,
    const StageVerifierOptions& options) {
  RuntimeOptions runtime_options;
  runtime_options.device = options.device;
  // Unencoded results: the comparison bounds the claim's codec itself.
  runtime_options.activation_encoding.codec = v1::CODEC_NONE;
  runtime_options.gradient_encoding.codec = v1::CODEC_NONE;
  std::unique_ptr<StageVerifier> verifier(
      new StageVerifier(job, placement, std::move(runtime_options), options));
  RETURN_IF_ERROR(verifier->Reset());
  return verifier;
}

absl::Status StageVerifier::Reset() {
  runtime_.reset();
  ASSIGN_OR_RETURN(runtime_, StageRuntime::Create(job_, placement_, runtime_options_));
  return absl::OkStatus();
}

// How far RecomputeNearby moves an input, relative to its RMS: about 100
// times float32's rounding, so that a preactivation within rounding of a
// ReLU's kink is flipped by one of the two signs, and a hundredth of the
// device term, so that where the result is smooth the bound barely grows
// (StageVerifierTest's lies are caught on as many elements as without).
constexpr double kNearbyInput = 1e-5;

// Units of 2^-24 the rounding of a softmax near 1 may differ by between two
// builds: exp, the sum and the log each round, a unit or two each; four
// times that for margin.
constexpr double kLossUlps = 16;

// `input` with its first tensor (float32) moved by `sign` * kNearbyInput of
// its RMS times a fixed pattern of +-1, re-encoded raw; nullopt when that
// tensor is not float32.
absl::StatusOr<std::optional<LinkMessage>> MovedInput(const LinkMessage& input, double sign) {
  if (input.header.tensors_size() == 0 ||
      input.header.tensors(0).dtype() != v1::DTYPE_FLOAT32) {
    return std::nullopt;
  }
  LinkMessage moved;
  moved.header = input.header;
  moved.header.clear_tensors();
  moved.header.clear_commitment();
  size_t offset = 0;
  try {
    for (int i = 0; i < input.header.tensors_size(); ++i) {
      const v1::TensorHeader& h = input.header.tensors(i);
      ASSIGN_OR_RETURN(torch::Tensor t, DecodeTensor(h, input.payload, offset));
      offset += h.payload_bytes();
      WireEncoding encoding;
      if (i == 0) {
        torch::Tensor x = t.to(torch::kFloat64);
        const torch::Tensor index = torch::arange(x.numel(), torch::kInt64).reshape(x.sizes());
        // A fixed pattern of signs, uncorrelated with any layer's rows.
        const torch::Tensor signs =
            (index * static_cast<int64_t>(2654435761)).remainder(7919).remainder(2) * 2 - 1;
        const double rms = x.square().mean().sqrt().item<double>();
        t = (x + sign * kNearbyInput * rms * signs.to(torch::kFloat64)).to(torch::kFloat32);
      } else {
        encoding.zstd = h.zstd();
      }
      RETURN_IF_ERROR(EncodeTensor(t, moved.header.add_tensors(), &moved.payload, encoding));
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("moving the input: ", e.what()));
  }
  return moved;
}

absl::StatusOr<LinkMessage> StageVerifier::Recompute(const AuditedComputation& audit) {
  const v1::MessageKind kind = audit.claim.header.kind();
  if (kind == v1::MESSAGE_KIND_ACTIVATION) {
    if (runtime_->is_last()) {
      return absl::InvalidArgumentError("the last stage sends no activation to audit");
    }
    return runtime_->Forward(audit.input);
  }
  if (runtime_->is_first()) {
    return absl::InvalidArgumentError("stage 0 sends no gradient to audit");
  }
  ASSIGN_OR_RETURN(std::optional<LinkMessage> up,
                   ForwardBackward(audit.input, audit.output_gradient));
  if (!up.has_value()) return absl::InternalError("the backward made no gradient");
  return std::move(*up);
}

absl::StatusOr<std::optional<LinkMessage>> StageVerifier::ForwardBackward(
    const LinkMessage& input, const std::optional<LinkMessage>& output_gradient) {
  if (runtime_->is_last()) {
    ASSIGN_OR_RETURN(LastStageResult result, runtime_->ForwardLoss(input));
    return std::move(result.gradient);
  }
  if (!output_gradient.has_value()) {
    return absl::FailedPreconditionError(
        "a gradient below the last stage needs the downstream neighbour's gradient");
  }
  ASSIGN_OR_RETURN(LinkMessage activation, runtime_->Forward(input));
  // The logged gradient names the audited stage's weight version; the
  // verifier's forward ran on its own copy of those weights.
  LinkMessage gradient = *output_gradient;
  const int stage = runtime_->placement().stage;
  if (gradient.header.weight_versions_size() <= stage ||
      activation.header.weight_versions_size() <= stage) {
    return absl::FailedPreconditionError("the gradient names no weight version for this stage");
  }
  gradient.header.set_weight_versions(stage, activation.header.weight_versions(stage));
  return runtime_->Backward(gradient);
}

absl::StatusOr<OutputComparison> StageVerifier::Verify(const AuditedComputation& audit) {
  const v1::MessageKind kind = audit.claim.header.kind();
  if (kind != v1::MESSAGE_KIND_ACTIVATION && kind != v1::MESSAGE_KIND_GRADIENT) {
    return absl::InvalidArgumentError("only activations and gradients are audited");
  }
  RETURN_IF_ERROR(CheckEvidence(audit.claim, "the claim"));
  if (!runtime_->is_first()) RETURN_IF_ERROR(CheckEvidence(audit.input, "the logged input"));
  RETURN_IF_ERROR(CheckSameMicrobatch(audit.input, audit.claim, "the input"));
  if (audit.output_gradient.has_value()) {
    RETURN_IF_ERROR(CheckEvidence(*audit.output_gradient, "the downstream gradient"));
    RETURN_IF_ERROR(
        CheckSameMicrobatch(*audit.output_gradient, audit.claim, "the downstream gradient"));
  }
  // The claim (its commitment checked above, and matched to its
  // receiver's log by the coordinator) fixes the weights.
  const std::string& committed = audit.claim.header.weights_digest();
  if (committed.empty()) return WrongWeights("the claim commits to no weights");
  runtime_->DropInFlight();
  RETURN_IF_ERROR(runtime_->RestoreCheckpoint(audit.weights));
  if (const std::string loaded = runtime_->WeightsDigest(); loaded != committed) {
    // Both are hex (StageRuntime::WeightsDigest); a hostile one is cut short.
    return WrongWeights(absl::StrCat("the weights supplied hash to ", loaded.substr(0, 16),
                                     "..., not the ", absl::CHexEscape(committed.substr(0, 16)),
                                     "... its output committed to"));
  }
  absl::StatusOr<LinkMessage> recomputed = Recompute(audit);
  runtime_->DropInFlight();
  RETURN_IF_ERROR(recomputed.status());
  OutputTolerance tolerance;
  tolerance.device = DeviceTolerance(audit.audited_device, options_.device);
  tolerance.max_violation_fraction = options_.max_violation_fraction;
  ASSIGN_OR_RETURN(OutputComparison result, CompareOutputs(audit.claim, *recomputed, tolerance));
  if (result.passed || !result.verifiable || !result.mismatch.empty()) return result;
  // Before failing anyone: is the input a rounding-sensitive point, where
  // another build's rounding alone may have flipped a unit? (Two more
  // recomputations, for failing comparisons only.)
  RoundingAllowance allowance;
  ASSIGN_OR_RETURN(allowance.nearby, RecomputeNearby(audit));
  // The last stage's gradient: the loss's own rounding.
  if (runtime_->is_last() && !runtime_->is_first()) {
    absl::StatusOr<LinkMessage> floor = runtime_->LossRoundingFloor(audit.input, kLossUlps);
    runtime_->DropInFlight();
    RETURN_IF_ERROR(floor.status());
    allowance.floor = *std::move(floor);
  }
  if (allowance.nearby.empty() && !allowance.floor.has_value()) return result;
  return CompareOutputs(audit.claim, *recomputed, tolerance, allowance);
}

absl::StatusOr<std::vector<LinkMessage>> StageVerifier::RecomputeNearby(
    const AuditedComputation& audit) {
  std::vector<LinkMessage> nearby;
  for (double sign : {1.0, -1.0}) {
    ASSIGN_OR_RETURN(std::optional<LinkMessage> input, MovedInput(audit.input, sign));
    if (!input.has_value()) return std::vector<LinkMessage>{};
    AuditedComputation moved = audit;
    moved.input = *std::move(input);
    absl::StatusOr<LinkMessage> result = Recompute(moved);
    runtime_->DropInFlight();
    RETURN_IF_ERROR(result.status());
    nearby.push_back(*std::move(result));
  }
  return nearby;
}

OutputComparison StageVerifier::WrongWeights(const std::string& why) {
  OutputComparison failed;
  failed.passed = false;
  failed.failure = why;
  return failed;
}

absl::StatusOr<LinkMessage> StageVerifier::LoadFirstStageInput(const DataShard& shard, int step,
                                                               uint64_t microbatch) {
  if (!runtime_->is_first()) {
    return absl::FailedPreconditionError("only stage 0 loads its input from the data");
  }
  runtime_->SetDataShard(shard.pipelines, shard.pipeline, shard.start_step, shard.base,
                         shard.microbatches, shard.block);
  return runtime_->LoadTrainMicrobatchById(step, static_cast<int64_t>(microbatch));
}

absl::Status StageVerifier::Load(const std::vector<v1::LayerCheckpoint>& weights,
                                 const std::string& digest, const char* what) {
  runtime_->DropInFlight();
  RETURN_IF_ERROR(runtime_->RestoreCheckpoint(weights));
  const std::string loaded = runtime_->WeightsDigest();
  if (loaded != digest) {
    return absl::FailedPreconditionError(absl::StrCat(what, " hash to ", loaded.substr(0, 16),
                                                      "..., not the committed ",
                                                      digest.substr(0, 16), "..."));
  }
  return absl::OkStatus();
}

absl::Status StageVerifier::Accumulate(const AuditedUpdate::Microbatch& microbatch) {
  return ForwardBackward(microbatch.input, microbatch.output_gradient).status();
}

absl::StatusOr<OutputComparison> StageVerifier::VerifyUpdate(const AuditedUpdate& audit) {
  if (runtime_->holds_one_tied_end()) {
    return absl::UnimplementedError(
        "this stage holds one end of a tied embedding: its update needs the other end's gradient");
  }
  if (audit.microbatches.empty()) {
    return absl::FailedPreconditionError("an update audit needs the update's microbatches");
  }
  for (const AuditedUpdate::Microbatch& m : audit.microbatches) {
    if (!runtime_->is_first()) RETURN_IF_ERROR(CheckEvidence(m.input, "a logged input"));
    if (m.output_gradient.has_value()) {
      RETURN_IF_ERROR(CheckEvidence(*m.output_gradient, "a downstream gradient"));
      RETURN_IF_ERROR(CheckSameMicrobatch(*m.output_gradient, m.input, "a downstream gradient"));
    }
  }
  std::string before_digest = audit.before_digest, after_digest = audit.after_digest;
  std::string before_state_digest, after_state_digest;  // during a job: committed
  if (audit.before_claim.has_value() || audit.after_claim.has_value()) {
    if (!audit.before_claim.has_value() || !audit.after_claim.has_value()) {
      return absl::FailedPreconditionError("an update audit needs both outputs");
    }
    RETURN_IF_ERROR(CheckEvidence(*audit.before_claim, "the step's output"));
    RETURN_IF_ERROR(CheckEvidence(*audit.after_claim, "the next step's output"));
    const int64_t before = SenderWeightVersion(audit.before_claim->header);
    const int64_t after = SenderWeightVersion(audit.after_claim->header);
    if (after < before) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the next step's output names weight version ", after, ", older than ", before));
    }
    if (after == before) {
      return WrongWeights(absl::StrCat("no update: the next step's output was computed with "
                                       "weight version ",
                                       before, " too"));
    }
    // Versions that are not updates (an outer step, replica averaging, a
    // restore) are counted in the outputs' weight_syncs: two outputs an
    // update apart differ by one version more than by syncs. A jump that
    // the syncs do not explain is a worker publishing versions of its own.
    const int64_t syncs_before = audit.before_claim->header.weight_syncs();
    const int64_t syncs_after = audit.after_claim->header.weight_syncs();
    if (syncs_after < syncs_before) {
      return WrongWeights(absl::StrCat("the next step's output counts ", syncs_after,
                                       " weight syncs, fewer than ", syncs_before));
    }
    if (after != before + 1 + (syncs_after - syncs_before)) {
      return WrongWeights(absl::StrCat("weight versions ", before, " and ", after, " with ",
                                       syncs_after - syncs_before,
                                       " weight syncs between are not one update apart"));
    }
    // Only a job with replicas or pipelines syncs weights within a plan; a
    // re-plan restores them (a new epoch).
    const bool same_epoch =
        audit.before_claim->header.epoch() == audit.after_claim->header.epoch();
    if (syncs_after > syncs_before && same_epoch && !job_.has_outer() && job_.replicas() <= 1) {
      return WrongWeights(absl::StrCat(syncs_after - syncs_before,
                                       " weight sync(s) claimed between two steps of one plan in "
                                       "a job without replicas or pipelines"));
    }
    if (syncs_after > syncs_before) {
      OutputComparison unverifiable;
      unverifiable.verifiable = false;
      unverifiable.unverifiable_reason = absl::StrCat(
          "weight versions ", before, " and ", after, " have ", syncs_after - syncs_before,
          " weight sync(s) between (an outer step or averaging): the update is not alone");
      return unverifiable;
    }
    before_digest = audit.before_claim->header.weights_digest();
    after_digest = audit.after_claim->header.weights_digest();
    if (before_digest.empty() || after_digest.empty()) {
      return WrongWeights("an output commits to no weights");
    }
    before_state_digest = audit.before_claim->header.state_digest();
    after_state_digest = audit.after_claim->header.state_digest();
    if (before_state_digest.empty() || after_state_digest.empty()) {
      return WrongWeights("an output commits to no optimizer state");
    }
  }
  // The weights supplied are the committed ones; those that are not fail
  // the audit. (A fresh optimizer each time: restoring keeps the larger
  // step count, and one step off moves AdamW's update by 6.5% here. Not a
  // fresh stage: stage 0's opens its dataset, seconds a time.)
  // So is the optimizer state, where the outputs committed to one.
  for (const auto& [weights, digest, state_digest, what] :
       {std::make_tuple(&audit.after, &after_digest, &after_state_digest,
                        "the weights claimed after the update"),
        std::make_tuple(&audit.before, &before_digest, &before_state_digest,
                        "the weights before the update")}) {
    RETURN_IF_ERROR(runtime_->ResetOptimizer());
    const absl::Status loaded = Load(*weights, *digest, what);
    if (absl::IsFailedPrecondition(loaded)) return WrongWeights(std::string(loaded.message()));
    RETURN_IF_ERROR(loaded);
    if (state_digest->empty()) continue;
    const std::string state = runtime_->OptimizerStateDigest();
    if (state != *state_digest) {
      return WrongWeights(absl::StrCat("the optimizer state with ", what, " hashes to ",
                                       state.substr(0, 16), "..., not the committed ",
                                       state_digest->substr(0, 16), "..."));
    }
  }
  absl::Status computed = absl::OkStatus();
  for (const AuditedUpdate::Microbatch& m : audit.microbatches) {
    computed = Accumulate(m);
    if (!computed.ok()) break;
  }
  if (computed.ok()) computed = runtime_->ApplyUpdate(audit.progress);
  absl::StatusOr<std::vector<v1::LayerCheckpoint>> mine =
      computed.ok() ? runtime_->ExportCheckpoint(0) : computed;
  runtime_->DropInFlight();
  RETURN_IF_ERROR(mine.status());
  UpdateTolerance tolerance;
  tolerance.device = DeviceTolerance(audit.audited_device, options_.device);
  tolerance.max_violation_fraction = options_.max_violation_fraction;
  return CompareUpdates(audit.before, audit.after, *mine, tolerance);
}

}  // namespace geotrain
