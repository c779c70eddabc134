#include "worker/audit_responder.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/rpc_options.h"
#include "worker/served_plan.h"
#include "worker/stage_verifier.h"

namespace geotrain {
namespace {

// What an upload may carry besides the evidence itself.
constexpr uint64_t kEnvelopeBytes = 64 << 10;

v1::LoggedLinkMessage ToProto(const LinkMessage& message) {
  v1::LoggedLinkMessage out;
  *out.mutable_header() = message.header;
  out.set_payload(message.payload);
  return out;
}

LinkMessage FromProto(const v1::LoggedLinkMessage& message) {
  LinkMessage out;
  out.header = message.header();
  out.payload = message.payload();
  return out;
}

}  // namespace

AuditResponder::AuditResponder(AuditResponderOptions options) : options_(std::move(options)) {
  thread_ = std::thread([this] { Loop(); });
}

AuditResponder::~AuditResponder() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}  // (verifier_ is destroyed here, where StageVerifier is complete)

void AuditResponder::SetJob(const v1::JobSpec& job) {
  auto copy = std::make_shared<const v1::JobSpec>(job);
  absl::MutexLock lock(&mu_);
  job_ = std::move(copy);
}

void AuditResponder::Enqueue(const v1::HeartbeatResponse& response) {
  absl::MutexLock lock(&mu_);
  for (const v1::EvidenceRequest& request : response.evidence_requests()) {
    if (queue_.size() >= options_.max_queued) break;
    queue_.push_back(Work{request, 0});
  }
  for (uint64_t id : response.verify_audits()) {
    if (queue_.size() >= options_.max_queued) break;
    queue_.push_back(Work{std::nullopt, id});
  }
}

void AuditResponder::Loop() {
  while (true) {
    Work work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](AuditResponder* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->stop_ || !self->queue_.empty();
          },
          this));
      if (stop_) return;
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    Do(work);
  }
}

v1::AuditEvidence AuditResponder::Gather(const v1::EvidenceRequest& request) const {
  v1::AuditEvidence evidence;
  evidence.set_worker_id(options_.calls.worker_id ? options_.calls.worker_id() : "");
  evidence.set_audit_id(request.audit_id());
  evidence.set_part(request.part());
  const v1::MessageKind output_kind =
      request.gradient() ? v1::MESSAGE_KIND_GRADIENT : v1::MESSAGE_KIND_ACTIVATION;
  auto missing = [&](const std::string& why) {
    evidence.set_found(false);
    evidence.set_detail(why);
    return evidence;
  };
  using Direction = CommitmentLog::Direction;
  const CommitmentLog& log = *options_.log;
  if (request.update()) {
    if (std::optional<std::string> why = GatherUpdate(request, &evidence); why.has_value()) {
      evidence.Clear();
      evidence.set_worker_id(options_.calls.worker_id ? options_.calls.worker_id() : "");
      evidence.set_audit_id(request.audit_id());
      evidence.set_part(request.part());
      return missing(*why);
    }
  } else {
    if (request.part() == v1::EvidenceRequest::RECEIPT) {
      std::optional<LoggedMessage> received =
          log.FindNewest(Direction::kReceived, output_kind, request.microbatch());
      if (!received.has_value()) return missing("no longer in the received log");
      evidence.set_found(true);
      evidence.set_received_commitment(received->commitment);
      return evidence;
    }
    const v1::MessageKind sent_kind = request.part() == v1::EvidenceRequest::SENT_INPUT
                                          ? v1::MESSAGE_KIND_ACTIVATION
                                          : output_kind;
    std::optional<LoggedMessage> sent =
        log.FindNewest(Direction::kSent, sent_kind, request.microbatch());
    if (!sent.has_value()) return missing("no longer in the sent log");
    if (sent->message == nullptr) return missing("its bytes are no longer kept");
    *evidence.mutable_message() = ToProto(*sent->message);
    if (request.part() == v1::EvidenceRequest::CLAIM) {
      const int64_t version = SenderWeightVersion(sent->message->header);
      // The version the output committed to (a version number recurs after
      // a rollback).
      std::optional<KeptWeights> weights =
          options_.weights->Find(version, sent->message->header.weights_digest());
      if (!weights.has_value()) {
        return missing(absl::StrCat("weight version ", version, " is no longer kept"));
      }
      absl::StatusOr<std::vector<v1::LayerCheckpoint>> layers = weights->export_layers();
      if (!layers.ok()) {
        return missing(absl::StrCat("weight version ", version, " could not be exported: ",
                                    layers.status().message()));
      }
      for (v1::LayerCheckpoint& layer : *layers) *evidence.add_weights() = std::move(layer);
      evidence.set_weights_digest(weights->digest);
      evidence.set_device(options_.device);
      // What this stage received to compute it (stage 0: data, no message).
      if (request.stage() > 0) {
        std::optional<LoggedMessage> input =
            log.FindNewest(Direction::kReceived, v1::MESSAGE_KIND_ACTIVATION, request.microbatch());
        if (!input.has_value()) return missing("its input is no longer in the received log");
        evidence.set_received_commitment(input->commitment);
      }
    }
  }
  const uint64_t limit = EvidenceLimit();
  if (evidence.ByteSizeLong() > limit) {
    const uint64_t bytes = evidence.ByteSizeLong();
    evidence.Clear();
    evidence.set_worker_id(options_.calls.worker_id ? options_.calls.worker_id() : "");
    evidence.set_audit_id(request.audit_id());
    evidence.set_part(request.part());
    return missing(absl::StrCat(bytes, " bytes, over the ", limit,
                                " one upload may carry (streamed evidence is still to come)"));
  }
  evidence.set_found(true);
  return evidence;
}

absl::StatusOr<StageVerifier*> AuditResponder::VerifierFor(const v1::AuditBundle& bundle,
                                                           const v1::JobSpec& job) {
  StagePlacement placement;
  placement.stage = bundle.stage();
  placement.num_stages = bundle.num_stages();
  placement.layer_begin = bundle.layer_begin();
  placement.layer_end = bundle.layer_end();
  // Audits load their weights into the verifier each time, so one made
  // for the same stage of the same job serves again.
  const std::string key = absl::StrCat(placement.stage, "/", placement.num_stages, "/",
                                       placement.layer_begin, "/", placement.layer_end);
  if (verifier_ == nullptr || verifier_key_ != key || verifier_job_.get() != &job) {
    verifier_.reset();
    StageVerifierOptions verifier_options;
    verifier_options.device = options_.device;
    ASSIGN_OR_RETURN(verifier_, StageVerifier::Create(job, placement, verifier_options));
    verifier_key_ = key;
  }
  return verifier_.get();
}

absl::StatusOr<LinkMessage> AuditResponder::FirstStageInput(const v1::AuditBundle& bundle,
                                                            const v1::JobSpec& job,
                                                            StageVerifier* verifier, int step,
                                                            uint64_t microbatch) {
  absl::StatusOr<ServedPlan> served = ServedPlan::For(bundle.plan(), job, bundle.audited_worker());
  if (!served.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the audited worker's data: ", served.status().message()));
  }
  DataShard shard;
  shard.pipelines = served->data_stride();
  shard.pipeline = served->data_lane();
  shard.start_step = served->start_step();
  shard.base = served->data_base();
  shard.microbatches = served->microbatches();
  shard.block = served->data_block();
  return verifier->LoadFirstStageInput(shard, step, microbatch);
}

std::optional<std::string> AuditResponder::GatherUpdate(const v1::EvidenceRequest& request,
                                                        v1::AuditEvidence* evidence) const {
  using Direction = CommitmentLog::Direction;
  const CommitmentLog& log = *options_.log;
  const v1::MessageKind output_kind =
      request.gradient() ? v1::MESSAGE_KIND_GRADIENT : v1::MESSAGE_KIND_ACTIVATION;
  switch (request.part()) {
    case v1::EvidenceRequest::SENT_INPUT:
    case v1::EvidenceRequest::SENT_GRADIENT: {
      const v1::MessageKind kind = request.part() == v1::EvidenceRequest::SENT_INPUT
                                       ? v1::MESSAGE_KIND_ACTIVATION
                                       : v1::MESSAGE_KIND_GRADIENT;
      for (uint64_t m : request.microbatches()) {
        std::optional<LoggedMessage> sent = log.FindNewest(Direction::kSent, kind, m);
        if (!sent.has_value()) {
          return absl::StrCat("microbatch ", m, " is no longer in the sent log");
        }
        if (sent->message == nullptr) {
          return absl::StrCat("microbatch ", m, "'s bytes are no longer kept");
        }
        *evidence->add_messages() = ToProto(*sent->message);
      }
      return std::nullopt;
    }
    case v1::EvidenceRequest::RECEIPT: {
      std::optional<LoggedMessage> received =
          log.FindNewest(Direction::kReceived, output_kind, request.microbatch());
      std::optional<LoggedMessage> next =
          log.FindNewest(Direction::kReceived, output_kind, request.next_microbatch());
      if (!received.has_value() || !next.has_value()) return "no longer in the received log";
      evidence->set_received_commitment(received->commitment);
      evidence->set_next_received_commitment(next->commitment);
      return std::nullopt;
    }
    case v1::EvidenceRequest::CLAIM: break;
    default: return "not a part of an update audit";
  }
  // The stage's outputs of the step and of the next one fix the weights
  // before and after the update (their committed digests).
  std::optional<LoggedMessage> before =
      log.FindNewest(Direction::kSent, output_kind, request.microbatch());
  std::optional<LoggedMessage> after =
      log.FindNewest(Direction::kSent, output_kind, request.next_microbatch());
  if (!before.has_value() || !after.has_value() || before->message == nullptr ||
      after->message == nullptr) {
    return "its outputs are no longer in the sent log";
  }
  *evidence->mutable_message() = ToProto(*before->message);
  *evidence->mutable_next_message() = ToProto(*after->message);
  const v1::LinkHeader& before_header = before->message->header;
  const v1::LinkHeader& after_header = after->message->header;
  std::optional<KeptWeights> weights_before =
      options_.weights->Find(SenderWeightVersion(before_header), before_header.weights_digest());
  std::optional<KeptWeights> weights_after =
      options_.weights->Find(SenderWeightVersion(after_header), after_header.weights_digest());
  if (weights_before.has_value() && !weights_before->export_with_state) {
    return "this stage's optimizer state is not kept: its update audits are too large to upload";
  }
  if (!weights_before.has_value() || !weights_after.has_value()) {
    return absl::StrCat("weight versions ", SenderWeightVersion(before_header), " and ",
                        SenderWeightVersion(after_header), " are no longer kept");
  }
  // Too large for one upload: said before anything is exported (a large
  // stage's update audits would otherwise copy megabytes to drop them).
  const uint64_t weights_bytes = weights_before->bytes + weights_after->bytes;
  if (weights_bytes > EvidenceLimit()) {
    return absl::StrCat("the weights and optimizer state come to ", weights_bytes,
                        " bytes, over the ", EvidenceLimit(),
                        " one upload may carry (streamed evidence is still to come)");
  }
  absl::StatusOr<std::vector<v1::LayerCheckpoint>> layers = weights_before->export_with_state();
  // The state after too: the verifier holds it to the next output's
  // commitment and to its own replay.
  absl::StatusOr<std::vector<v1::LayerCheckpoint>> layers_after =
      weights_after->export_with_state ? weights_after->export_with_state()
                                       : weights_after->export_layers();
  if (!layers.ok() || !layers_after.ok()) {
    return absl::StrCat("the kept weights could not be exported: ",
                        (layers.ok() ? layers_after.status() : layers.status()).message());
  }
  for (v1::LayerCheckpoint& layer : *layers) *evidence->add_weights() = std::move(layer);
  for (v1::LayerCheckpoint& layer : *layers_after) {
    *evidence->add_weights_after() = std::move(layer);
  }
  evidence->set_weights_digest(weights_before->digest);
  evidence->set_device(options_.device);
  // What the stage received to compute the update.
  for (uint64_t m : request.microbatches()) {
    if (request.stage() > 0) {
      std::optional<LoggedMessage> input =
          log.FindNewest(Direction::kReceived, v1::MESSAGE_KIND_ACTIVATION, m);
      if (!input.has_value()) return absl::StrCat("microbatch ", m, "'s input is no longer logged");
      evidence->add_received_commitments(input->commitment);
    }
    if (!request.gradient()) {  // below the last stage: a gradient came back
      std::optional<LoggedMessage> gradient =
          log.FindNewest(Direction::kReceived, v1::MESSAGE_KIND_GRADIENT, m);
      if (!gradient.has_value()) {
        return absl::StrCat("microbatch ", m, "'s gradient is no longer logged");
      }
      evidence->add_received_gradient_commitments(gradient->commitment);
    }
  }
  return std::nullopt;
}

v1::AuditVerdict AuditResponder::VerifyBundle(const v1::AuditBundle& bundle) {
  v1::AuditVerdict verdict;
  verdict.set_worker_id(options_.calls.worker_id ? options_.calls.worker_id() : "");
  verdict.set_audit_id(bundle.audit_id());
  std::shared_ptr<const v1::JobSpec> job;
  {
    absl::MutexLock lock(&mu_);
    job = job_;
  }
  auto not_run = [&](const std::string& why) {
    verdict.set_ran(false);
    verdict.set_summary(why);
    return verdict;
  };
  if (job == nullptr) return not_run("this worker has no job yet");
  absl::StatusOr<StageVerifier*> verifier = VerifierFor(bundle, *job);
  if (!verifier.ok()) return not_run(std::string(verifier.status().message()));
  verifier_job_ = job;  // held: its address is the verifier's key
  if (bundle.update()) {
    v1::AuditVerdict update = VerifyUpdateBundle(bundle, *job, *verifier);
    update.set_worker_id(verdict.worker_id());
    update.set_audit_id(verdict.audit_id());
    return update;
  }
  AuditedComputation audit;
  audit.weights.assign(bundle.weights().begin(), bundle.weights().end());
  audit.claim = FromProto(bundle.claim());
  if (bundle.stage() == 0) {
    // The audited worker's microbatch, loaded from its share of the data.
    absl::StatusOr<LinkMessage> input =
        FirstStageInput(bundle, *job, *verifier, audit.claim.header.step(),
                        audit.claim.header.microbatch());
    if (!input.ok()) return not_run(std::string(input.status().message()));
    audit.input = *std::move(input);
    audit.input.header.set_epoch(audit.claim.header.epoch());  // data has none of its own
  } else {
    audit.input = FromProto(bundle.input());
  }
  audit.audited_device = bundle.audited_device().empty() ? "cpu" : bundle.audited_device();
  absl::StatusOr<OutputComparison> comparison = (*verifier)->Verify(audit);
  if (!comparison.ok()) return not_run(std::string(comparison.status().message()));
  verdict.set_ran(true);
  verdict.set_passed(comparison->passed);
  verdict.set_verifiable(comparison->verifiable);
  verdict.set_summary(comparison->Summary());
  return verdict;
}

v1::AuditVerdict AuditResponder::VerifyUpdateBundle(const v1::AuditBundle& bundle,
                                                    const v1::JobSpec& job,
                                                    StageVerifier* verifier) {
  v1::AuditVerdict verdict;
  auto not_run = [&](const std::string& why) {
    verdict.set_ran(false);
    verdict.set_summary(why);
    return verdict;
  };
  const bool first = bundle.stage() == 0;
  const bool last = bundle.stage() + 1 == bundle.num_stages();
  const int count = bundle.microbatches_size();
  if (count == 0 || (!first && bundle.inputs_size() != count) ||
      (!last && bundle.output_gradients_size() != count)) {
    return not_run("the update's evidence does not hold one message per microbatch");
  }
  AuditedUpdate update;
  update.before.assign(bundle.weights().begin(), bundle.weights().end());
  update.after.assign(bundle.weights_after().begin(), bundle.weights_after().end());
  update.before_claim = FromProto(bundle.claim());
  update.after_claim = FromProto(bundle.next_claim());
  update.progress = bundle.progress();
  update.audited_device = bundle.audited_device().empty() ? "cpu" : bundle.audited_device();
  for (int i = 0; i < count; ++i) {
    AuditedUpdate::Microbatch& m = update.microbatches.emplace_back();
    if (first) {
      absl::StatusOr<LinkMessage> input =
          FirstStageInput(bundle, job, verifier, update.before_claim->header.step(),
                          bundle.microbatches(i));
      if (!input.ok()) return not_run(std::string(input.status().message()));
      m.input = *std::move(input);
      m.input.header.set_epoch(update.before_claim->header.epoch());
    } else {
      m.input = FromProto(bundle.inputs(i));
    }
    if (!last) m.output_gradient = FromProto(bundle.output_gradients(i));
  }
  absl::StatusOr<OutputComparison> comparison = verifier->VerifyUpdate(update);
  if (!comparison.ok()) return not_run(std::string(comparison.status().message()));
  verdict.set_ran(true);
  verdict.set_passed(comparison->passed);
  verdict.set_verifiable(comparison->verifiable);
  verdict.set_summary(absl::StrCat("update: ", comparison->Summary()));
  return verdict;
}

void AuditResponder::Do(const Work& work) {
  if (work.evidence.has_value()) {
    const v1::AuditEvidence evidence = Gather(*work.evidence);
    const absl::Status uploaded = options_.calls.upload(evidence);
    if (!uploaded.ok()) {
      GT_LOG(Warning) << "audit " << evidence.audit_id() << ": evidence upload failed: "
                      << uploaded.message();
    }
    absl::MutexLock lock(&mu_);
    ++(evidence.found() ? counts_.evidence_sent : counts_.evidence_missing);
    return;
  }
  absl::StatusOr<v1::AuditBundle> bundle = options_.calls.fetch(work.verify);
  if (!bundle.ok()) {
    GT_LOG(Warning) << "audit " << work.verify << ": fetch failed: " << bundle.status().message();
    return;
  }
  v1::AuditVerdict verdict = VerifyBundle(*bundle);
  if (options_.tamper_verdict) options_.tamper_verdict(&verdict);
  GT_LOG(Info) << "audit " << work.verify << " of stage " << bundle->stage() << ", microbatch "
               << bundle->claim().header().microbatch() << ": "
               << (!verdict.ran()          ? "not run"
                   : verdict.passed()     ? "passed"
                   : verdict.verifiable() ? "FAILED"
                                          : "unverifiable") << " ("
               << verdict.summary() << ")";
  const absl::Status reported = options_.calls.report(verdict);
  if (!reported.ok()) {
    GT_LOG(Warning) << "audit " << work.verify << ": verdict not reported: "
                    << reported.message();
  }
  absl::MutexLock lock(&mu_);
  ++counts_.verified;
  if (verdict.ran() && !verdict.passed()) ++counts_.failed;
}

uint64_t AuditResponder::EvidenceLimit() const {
  return options_.max_evidence_bytes > 0
             ? options_.max_evidence_bytes
             : static_cast<uint64_t>(kCoordinatorMaxReceiveBytes) - kEnvelopeBytes;
}

AuditResponder::Counts AuditResponder::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

}  // namespace geotrain
