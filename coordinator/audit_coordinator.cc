#include "coordinator/audit_coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/plan_util.h"

namespace geotrain {
namespace {

const char* PartName(v1::EvidenceRequest::Part part) {
  switch (part) {
    case v1::EvidenceRequest::SENT_INPUT: return "input";
    case v1::EvidenceRequest::CLAIM: return "claim";
    case v1::EvidenceRequest::RECEIPT: return "receipt";
    case v1::EvidenceRequest::SENT_GRADIENT: return "downstream gradients";
    default: return "?";
  }
}

// The first bytes of a commitment, for events.
std::string Short(const std::string& commitment) {
  return absl::BytesToHexString(commitment.substr(0, 8));
}

uint64_t EvidenceBytes(const v1::AuditEvidence& evidence) {
  return evidence.ByteSizeLong();
}

// How an audit names itself in events.
std::string What(const Audit& audit) {
  return audit.update ? absl::StrCat("the update after step ", audit.step)
                      : absl::StrCat("microbatch ", audit.microbatch);
}

// What is wrong with `evidence` for update audit `audit`: empty when it is
// the part asked for, of the microbatches asked for.
std::string UpdateEvidenceProblem(const Audit& audit, const v1::AuditEvidence& evidence) {
  const int count = static_cast<int>(audit.microbatches.size());
  auto each_is = [&](v1::MessageKind kind) -> std::string {
    if (evidence.messages_size() != count) {
      return absl::StrCat("carries ", evidence.messages_size(), " messages, not ", count);
    }
    for (int i = 0; i < count; ++i) {
      const v1::LinkHeader& header = evidence.messages(i).header();
      if (header.kind() != kind || header.microbatch() != audit.microbatches[i]) {
        return absl::StrCat("message ", i, " is not microbatch ", audit.microbatches[i], "'s");
      }
    }
    return "";
  };
  auto is = [](const v1::LoggedLinkMessage& message, v1::MessageKind kind, uint64_t microbatch) {
    return message.header().kind() == kind && message.header().microbatch() == microbatch;
  };
  switch (evidence.part()) {
    case v1::EvidenceRequest::SENT_INPUT: return each_is(v1::MESSAGE_KIND_ACTIVATION);
    case v1::EvidenceRequest::SENT_GRADIENT: return each_is(v1::MESSAGE_KIND_GRADIENT);
    case v1::EvidenceRequest::CLAIM:
      if (!is(evidence.message(), audit.kind, audit.microbatch) ||
          !is(evidence.next_message(), audit.kind, audit.next_microbatch)) {
        return absl::StrCat("is not the outputs of microbatches ", audit.microbatch, " and ",
                            audit.next_microbatch);
      }
      if (evidence.weights().empty() || evidence.weights_after().empty()) {
        return "misses the weights before or after the update";
      }
      if (evidence.received_commitments_size() != (audit.upstream.empty() ? 0 : count) ||
          evidence.received_gradient_commitments_size() !=
              (audit.downstream.empty() ? 0 : count)) {
        return "does not carry one received commitment per microbatch";
      }
      return "";
    default:
      if (evidence.received_commitment().empty() || evidence.next_received_commitment().empty()) {
        return "misses a received commitment";
      }
      return "";
  }
}

// Drawing a step costs a draw per (pipeline, stage, microbatch): after a
// jump (a restored coordinator) only the newest steps are drawn.
constexpr int kMaxStepsDrawnAtOnce = 16;

}  // namespace

AuditCoordinator::AuditCoordinator(SpotCheckDraw draw, AuditCoordinatorOptions options)
    : options_(std::move(options)), manager_(std::move(draw), options_.audits) {}

std::string AuditCoordinator::Name(const std::string& id) const {
  return options_.name_of ? options_.name_of(id) : id;
}

void AuditCoordinator::SetSuspicion(std::function<bool(const std::string&)> is_suspect) {
  absl::MutexLock lock(&mu_);
  is_suspect_ = std::move(is_suspect);
}

void AuditCoordinator::AskLocked(const std::string& worker, const Pending& pending,
                                 v1::EvidenceRequest::Part part) {
  v1::EvidenceRequest request;
  request.set_audit_id(pending.audit.id);
  request.set_part(part);
  request.set_gradient(pending.audit.kind == v1::MESSAGE_KIND_GRADIENT);
  request.set_microbatch(pending.audit.microbatch);
  request.set_stage(pending.audit.stage);
  if (pending.audit.update) {
    request.set_update(true);
    for (uint64_t m : pending.audit.microbatches) request.add_microbatches(m);
    request.set_next_microbatch(pending.audit.next_microbatch);
  }
  evidence_asks_[worker].push_back(std::move(request));
}

void AuditCoordinator::OnCommitted(const v1::Plan& plan, int committed_step, int job_microbatches,
                                   const std::vector<std::string>& standbys) {
  absl::MutexLock lock(&mu_);
  if (plan.epoch() != drawn_epoch_) {
    // A new plan draws the steps it commits from here on; after a restore
    // to an older step, those it commits again. (A step committed under
    // the old plan is not drawn again under the new one: its members did
    // not compute it.)
    drawn_epoch_ = plan.epoch();
    drawn_through_ = std::min(drawn_through_, committed_step);
    // Its workers new to a stage are trusted up to where it starts; those
    // that left it are forgotten.
    std::map<std::string, Trust> trusted;
    for (const v1::StageAssignment& stage : plan.stages()) {
      for (const StageWorker& w : WorkersOf(stage)) {
        auto known = trusted_.find(w.id);
        trusted[w.id] = known != trusted_.end()
                            ? known->second
                            : Trust{plan.start_step(), plan.start_step()};
      }
    }
    trusted_ = std::move(trusted);
  }
  const int first = std::max(drawn_through_ + 1, committed_step - kMaxStepsDrawnAtOnce + 1);
  std::shared_ptr<const v1::Plan> shared_plan;  // for stage-0 audits, copied once
  const std::function<bool(const std::string&)> suspect = [this](const std::string& id) {
    mu_.AssertHeld();
    return disputed_.count(id) > 0 || (is_suspect_ && is_suspect_(id));
  };
  for (int step = first; step <= committed_step; ++step) {
    for (Audit& audit : manager_.OnStepCommitted(plan, step, job_microbatches, standbys, suspect)) {
      Pending pending;
      pending.audit = audit;
      pending.num_stages = plan.stages_size();
      for (const v1::StageAssignment& s : plan.stages()) {
        if (s.stage() == audit.stage) {
          pending.layer_begin = s.layer_begin();
          pending.layer_end = s.layer_end();
        }
      }
      pending.opened_ms = options_.clock->NowMs();
      // The receiver of the output: downstream for an activation, upstream
      // for a gradient.
      const std::string& receiver =
          audit.kind == v1::MESSAGE_KIND_GRADIENT ? audit.upstream : audit.downstream;
      if (audit.stage == 0) {
        // Its input is data: the verifier loads it (the plan says whose).
        if (shared_plan == nullptr) shared_plan = std::make_shared<const v1::Plan>(plan);
        pending.plan = shared_plan;
      } else {
        pending.owed[v1::EvidenceRequest::SENT_INPUT] = audit.upstream;
      }
      if (audit.update && !audit.downstream.empty()) {
        pending.owed[v1::EvidenceRequest::SENT_GRADIENT] = audit.downstream;
      }
      pending.owed[v1::EvidenceRequest::CLAIM] = audit.audited;
      pending.owed[v1::EvidenceRequest::RECEIPT] = receiver;
      for (const auto& [part, worker] : pending.owed) AskLocked(worker, pending, part);
      pending_[audit.id] = std::move(pending);
    }
  }
  drawn_through_ = std::max(drawn_through_, committed_step);
}

void AuditCoordinator::FillHeartbeat(const std::string& worker_id,
                                     v1::HeartbeatResponse* response) {
  absl::MutexLock lock(&mu_);
  if (auto it = evidence_asks_.find(worker_id); it != evidence_asks_.end()) {
    for (v1::EvidenceRequest& request : it->second) {
      *response->add_evidence_requests() = std::move(request);
    }
    evidence_asks_.erase(it);
  }
  if (auto it = verify_asks_.find(worker_id); it != verify_asks_.end()) {
    for (uint64_t id : it->second) response->add_verify_audits(id);
    verify_asks_.erase(it);
  }
}

absl::Status AuditCoordinator::AcceptEvidence(const std::string& caller,
                                              const v1::AuditEvidence& evidence) {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(evidence.audit_id());
  if (it == pending_.end()) {
    return absl::NotFoundError(absl::StrCat("no audit ", evidence.audit_id(), " owes evidence"));
  }
  Pending& pending = it->second;
  auto owed = pending.owed.find(evidence.part());
  if (owed == pending.owed.end() || owed->second != caller) {
    return absl::PermissionDeniedError(absl::StrCat(caller.substr(0, 128), " owes no ",
                                                    PartName(evidence.part()), " of audit ",
                                                    evidence.audit_id()));
  }
  const uint64_t id = pending.audit.id;
  if (!evidence.found()) {
    AbandonLocked(id, "audit_evidence_missing", caller,
                  absl::StrCat("audit ", id, ": ", Name(caller), " no longer holds the ",
                               PartName(evidence.part()), " of ", What(pending.audit), " (",
                               evidence.detail().substr(0, 200), ")"));
    return absl::OkStatus();
  }
  if (pending.audit.update) {
    if (const std::string wrong = UpdateEvidenceProblem(pending.audit, evidence); !wrong.empty()) {
      AbandonLocked(id, "audit_evidence_refused", caller,
                    absl::StrCat("audit ", id, ": ", Name(caller), "'s ",
                                 PartName(evidence.part()), " ", wrong));
      return absl::InvalidArgumentError(absl::StrCat("evidence of another update: ", wrong));
    }
  }
  const bool wants_message = !pending.audit.update &&
                             evidence.part() != v1::EvidenceRequest::RECEIPT;
  const v1::MessageKind kind = evidence.part() == v1::EvidenceRequest::SENT_INPUT
                                   ? v1::MESSAGE_KIND_ACTIVATION
                                   : pending.audit.kind;
  if (wants_message && (evidence.message().header().kind() != kind ||
                        evidence.message().header().microbatch() != pending.audit.microbatch)) {
    AbandonLocked(id, "audit_evidence_refused", caller,
                  absl::StrCat("audit ", id, ": ", Name(caller), "'s ", PartName(evidence.part()),
                               " is not microbatch ", pending.audit.microbatch, "'s"));
    return absl::InvalidArgumentError("evidence of another message than asked");
  }
  if (evidence.part() == v1::EvidenceRequest::RECEIPT && evidence.received_commitment().empty()) {
    return absl::InvalidArgumentError("a receipt without a commitment");
  }
  const uint64_t bytes = EvidenceBytes(evidence);
  if (evidence_bytes_ + bytes > options_.max_evidence_bytes) {
    AbandonLocked(id, "audit_evidence_refused", caller,
                  absl::StrCat("audit ", id, ": evidence over the coordinator's bound of ",
                               options_.max_evidence_bytes, " bytes"));
    return absl::ResourceExhaustedError("the coordinator holds all the evidence it may");
  }
  evidence_bytes_ += bytes;
  evidence_bytes_total_ += bytes;
  pending.bytes += bytes;
  switch (evidence.part()) {
    case v1::EvidenceRequest::SENT_INPUT: pending.input = evidence; break;
    case v1::EvidenceRequest::CLAIM: pending.claim = evidence; break;
    case v1::EvidenceRequest::SENT_GRADIENT: pending.gradients = evidence; break;
    default: pending.receipt = evidence; break;
  }
  pending.owed.erase(owed);
  if (pending.owed.empty()) OnEvidenceCompleteLocked(&pending);
  return absl::OkStatus();
}

void AuditCoordinator::OnEvidenceCompleteLocked(Pending* pending) {
  const Audit& audit = pending->audit;
  const uint64_t id = audit.id;
  auto dispute = [&](const std::string& a, const std::string& b, const std::string& what) {
    ++disputes_;
    disputed_.insert(a);
    disputed_.insert(b);
    AbandonLocked(id, "audit_disputed", audit.audited,
                  absl::StrCat("audit ", id, " (stage ", audit.stage, ", ", What(audit), "): ",
                               what, "; ", Name(a), " and ", Name(b),
                               " are audited at the suspect's rate from now on"));
  };
  if (audit.update) {
    // Every microbatch's input and downstream gradient as their senders
    // logged them, against what the audited stage logged receiving.
    const v1::AuditEvidence& claim = *pending->claim;
    for (int i = 0; i < static_cast<int>(audit.microbatches.size()); ++i) {
      if (pending->input.has_value()) {
        const std::string& sent = pending->input->messages(i).header().commitment();
        if (sent != claim.received_commitments(i)) {
          dispute(audit.upstream, audit.audited,
                  absl::StrCat(Name(audit.upstream), " logged sending microbatch ",
                               audit.microbatches[i], "'s input committed as ", Short(sent), ", ",
                               Name(audit.audited), " logged receiving ",
                               Short(claim.received_commitments(i))));
          return;
        }
      }
      if (pending->gradients.has_value()) {
        const std::string& sent = pending->gradients->messages(i).header().commitment();
        if (sent != claim.received_gradient_commitments(i)) {
          dispute(audit.downstream, audit.audited,
                  absl::StrCat(Name(audit.downstream), " logged sending microbatch ",
                               audit.microbatches[i], "'s gradient committed as ", Short(sent),
                               ", ", Name(audit.audited), " logged receiving ",
                               Short(claim.received_gradient_commitments(i))));
          return;
        }
      }
    }
    const std::string& receiver = pending->receipt->worker_id();
    for (const auto& [sent, received] :
         {std::make_pair(&claim.message(), &pending->receipt->received_commitment()),
          std::make_pair(&claim.next_message(), &pending->receipt->next_received_commitment())}) {
      if (sent->header().commitment() != *received) {
        dispute(audit.audited, receiver,
                absl::StrCat(Name(audit.audited), " logged sending an output committed as ",
                             Short(sent->header().commitment()), ", ", Name(receiver),
                             " logged receiving ", Short(*received)));
        return;
      }
    }
    pending->asked_verifier_ms = options_.clock->NowMs();
    verify_asks_[audit.verifiers.back()].push_back(id);
    return;
  }
  const std::string input_commitment =
      pending->input.has_value() ? pending->input->message().header().commitment() : "";
  if (pending->input.has_value() && input_commitment != pending->claim->received_commitment()) {
    dispute(audit.upstream, audit.audited,
            absl::StrCat(Name(audit.upstream), " logged sending an input committed as ",
                         Short(input_commitment), ", ", Name(audit.audited),
                         " logged receiving ", Short(pending->claim->received_commitment())));
    return;
  }
  const std::string& claim_commitment = pending->claim->message().header().commitment();
  const std::string& receiver = pending->receipt->worker_id();
  if (claim_commitment != pending->receipt->received_commitment()) {
    dispute(audit.audited, receiver,
            absl::StrCat(Name(audit.audited), " logged sending an output committed as ",
                         Short(claim_commitment), ", ", Name(receiver), " logged receiving ",
                         Short(pending->receipt->received_commitment())));
    return;
  }
  pending->asked_verifier_ms = options_.clock->NowMs();
  verify_asks_[audit.verifiers.back()].push_back(id);
}

absl::StatusOr<v1::AuditBundle> AuditCoordinator::Fetch(const std::string& caller,
                                                        uint64_t audit_id) const {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(audit_id);
  if (it == pending_.end() || it->second.asked_verifier_ms == 0) {
    return absl::NotFoundError(absl::StrCat("no audit ", audit_id, " to verify"));
  }
  const Pending& pending = it->second;
  if (pending.audit.verifiers.empty() || pending.audit.verifiers.back() != caller) {
    return absl::PermissionDeniedError(
        absl::StrCat(caller.substr(0, 128), " is not audit ", audit_id, "'s verifier"));
  }
  v1::AuditBundle bundle;
  bundle.set_audit_id(audit_id);
  bundle.set_stage(pending.audit.stage);
  bundle.set_num_stages(pending.num_stages);
  bundle.set_layer_begin(pending.layer_begin);
  bundle.set_layer_end(pending.layer_end);
  *bundle.mutable_weights() = pending.claim->weights();
  if (pending.input.has_value()) *bundle.mutable_input() = pending.input->message();
  if (pending.plan != nullptr) {
    *bundle.mutable_plan() = *pending.plan;
    bundle.set_audited_worker(pending.audit.audited);
  }
  *bundle.mutable_claim() = pending.claim->message();
  bundle.set_audited_device(pending.claim->device());
  bundle.set_weights_digest(pending.claim->weights_digest());
  if (pending.audit.update) {
    bundle.set_update(true);
    bundle.set_step(pending.audit.step);
    for (uint64_t m : pending.audit.microbatches) bundle.add_microbatches(m);
    if (pending.input.has_value()) *bundle.mutable_inputs() = pending.input->messages();
    if (pending.gradients.has_value()) {
      *bundle.mutable_output_gradients() = pending.gradients->messages();
    }
    *bundle.mutable_next_claim() = pending.claim->next_message();
    *bundle.mutable_weights_after() = pending.claim->weights_after();
    // The driver's position at that update is the step's microbatches
    // finished, over the run's (PipelineDriver::AfterBackward).
    bundle.set_progress(options_.total_steps > 0 ? static_cast<double>(pending.audit.step) /
                                                       options_.total_steps
                                                 : 0.0);
  }
  fetched_bytes_total_ += bundle.ByteSizeLong();
  return bundle;
}

absl::Status AuditCoordinator::AcceptVerdict(const std::string& caller,
                                             const v1::AuditVerdict& verdict,
                                             const v1::Plan& plan,
                                             const std::vector<std::string>& standbys) {
  struct Eviction {
    std::string worker, why;
    std::optional<int> trusted_step;
  };
  std::vector<Eviction> evictions;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(verdict.audit_id());
    if (it == pending_.end() || it->second.asked_verifier_ms == 0 ||
        it->second.audit.verifiers.back() != caller) {
      return absl::PermissionDeniedError(absl::StrCat(
          caller.substr(0, 128), " was not asked for audit ", verdict.audit_id(), "'s verdict"));
    }
    Pending& pending = it->second;
    const uint64_t id = pending.audit.id;
    if (!verdict.ran()) {
      AbandonLocked(id, "audit_not_run", caller,
                    absl::StrCat("audit ", id, ": ", Name(caller), " could not run it: ",
                                 verdict.summary().substr(0, 300)));
      return absl::OkStatus();
    }
    absl::StatusOr<AuditDecision> decision =
        manager_.OnVerdict(id, caller, verdict.passed(), verdict.verifiable(),
                           verdict.summary().substr(0, 500), plan, standbys);
    if (!decision.ok()) return decision.status();
    pending.audit = decision->audit;
    const Audit& audit = decision->audit;
    const std::string what = absl::StrCat(
        "audit ", id, " of ", Name(audit.audited), " (stage ", audit.stage, ", step ", audit.step,
        ", ", What(audit), ", claim ", Short(pending.claim->message().header().commitment()),
        ")");
    options_.events->Add(verdict.passed()        ? "audit_passed"
                         : !verdict.verifiable() ? "audit_unverifiable"
                                                 : "audit_failed",
                         Name(caller),
                         absl::StrCat(what, ": ", verdict.summary().substr(0, 300)));
    if (decision->ask.has_value()) {
      pending.asked_verifier_ms = options_.clock->NowMs();
      verify_asks_[*decision->ask].push_back(id);
      return absl::OkStatus();
    }
    if (audit.state == Audit::State::kPassed) {
      if (auto trusted = trusted_.find(audit.audited); trusted != trusted_.end()) {
        Trust& trust = trusted->second;
        trust.outputs = std::max(trust.outputs, audit.step);
        // Without update audits, outputs are all there is to go by.
        if (audit.update || !options_.audits.audit_updates) {
          trust.weights = std::max(trust.weights, audit.step);
        }
      }
    }
    // Weight syncs claimed between more of its updates than its job makes:
    // a worker that skips updates and claims a sync at each, so that their
    // audits cannot be recomputed. Read from its own two outputs, as
    // committed and confirmed by their receiver, not from any verifier's
    // word: a verifier that calls an honest worker's audits unverifiable
    // cannot get it evicted by this.
    if (audit.update && audit.state != Audit::State::kOpen && pending.claim.has_value()) {
      UpdateAudits& updates = update_audits_[audit.audited];
      ++updates.closed;
      const bool syncs_between = pending.claim->next_message().header().weight_syncs() >
                                 pending.claim->message().header().weight_syncs();
      if (syncs_between) ++updates.with_syncs;
      if (syncs_between &&
          UnverifiableUpdatesUnexplained(updates.closed, updates.with_syncs,
                                         options_.audits.update_sync_rate) &&
          !evicted_.count(audit.audited)) {
        evicted_.insert(audit.audited);
        auto trusted = trusted_.find(audit.audited);
        const int trusted_to =
            trusted == trusted_.end() ? TrustedFloorLocked() : trusted->second.weights;
        evictions.push_back(
            {audit.audited,
             absl::StrCat(what, ": ", updates.with_syncs, " of its ", updates.closed,
                          " update audits had weight syncs between, far more than its job's "
                          "syncs explain (about ",
                          absl::StrFormat("%.1f", options_.audits.update_sync_rate *
                                                      static_cast<double>(updates.closed)),
                          ")"),
             std::max(0, std::min(trusted_to, audit.step - 1))});
      }
    }
    for (const std::string& worker : decision->evict) {
      // Once: the other open audits of an evicted worker end with it.
      if (!evicted_.insert(worker).second) continue;
      std::optional<int> trusted_step;
      if (audit.state == Audit::State::kConfirmed && worker == audit.audited) {
        auto trusted = trusted_.find(worker);
        // Not of the plan any more (it left as it was caught): nobody
        // past the floor is trusted. A pass of a later step (a worker that
        // lies on some microbatches) does not vouch for the one caught.
        // Caught in an update, its weights are wrong from then on: an
        // output audit that passed since vouched only for its outputs from
        // the weights it held.
        const int trusted_to = trusted == trusted_.end() ? TrustedFloorLocked()
                               : audit.update        ? trusted->second.weights
                                                     : trusted->second.outputs;
        trusted_step = std::max(0, std::min(trusted_to, audit.step - 1));
      }
      evictions.push_back({worker, absl::StrCat(what, ": ", decision->reason), trusted_step});
    }
    if (audit.state == Audit::State::kUndecided) {
      options_.events->Add("audit_undecided", Name(audit.audited), decision->reason);
    }
    ForgetLocked(id);
    for (const Eviction& eviction : evictions) {
      const std::string& worker = eviction.worker;
      std::vector<uint64_t> moot;
      for (const auto& [other, p] : pending_) {
        // Its own audits, and those waiting on its verdict.
        if (p.audit.audited == worker ||
            (p.asked_verifier_ms > 0 && p.audit.verifiers.back() == worker)) {
          moot.push_back(other);
        }
      }
      for (uint64_t other : moot) {
        manager_.Abandon(other);
        ForgetLocked(other);
      }
    }
  }
  // Off the lock: eviction re-plans.
  for (const Eviction& eviction : evictions) {
    options_.events->Add("audit_evicted", Name(eviction.worker), eviction.why);
    options_.evict(eviction.worker, eviction.why, eviction.trusted_step);
  }
  return absl::OkStatus();
}

int AuditCoordinator::TrustedFloor() const {
  absl::MutexLock lock(&mu_);
  return TrustedFloorLocked();
}

int AuditCoordinator::TrustedFloorLocked() const {
  int floor = -1;
  for (const auto& [worker, trust] : trusted_) {
    const int step = std::min(trust.outputs, trust.weights);
    floor = floor < 0 ? step : std::min(floor, step);
  }
  return floor;
}

void AuditCoordinator::RolledBack(int step) {
  absl::MutexLock lock(&mu_);
  for (auto& [worker, trust] : trusted_) {
    trust.outputs = std::min(trust.outputs, step);
    trust.weights = std::min(trust.weights, step);
  }
}

void AuditCoordinator::AbandonLocked(uint64_t id, const std::string& kind,
                                     const std::string& worker, const std::string& why) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  manager_.Abandon(id);
  options_.events->Add(kind, Name(worker), why);
  ForgetLocked(id);
}

void AuditCoordinator::ForgetLocked(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  evidence_bytes_ -= std::min(evidence_bytes_, it->second.bytes);
  pending_.erase(it);
}

void AuditCoordinator::Expire() {
  absl::MutexLock lock(&mu_);
  const int64_t now = options_.clock->NowMs();
  std::vector<std::pair<uint64_t, std::string>> overdue;
  for (const auto& [id, pending] : pending_) {
    if (pending.asked_verifier_ms == 0 && now - pending.opened_ms > options_.evidence_timeout_ms) {
      std::string who;
      for (const auto& [part, worker] : pending.owed) {
        absl::StrAppend(&who, who.empty() ? "" : ", ", Name(worker), " (", PartName(part), ")");
      }
      overdue.emplace_back(id, absl::StrCat("evidence not uploaded within ",
                                            options_.evidence_timeout_ms, " ms by ", who));
    } else if (pending.asked_verifier_ms > 0 &&
               now - pending.asked_verifier_ms > options_.verdict_timeout_ms) {
      overdue.emplace_back(id, absl::StrCat("no verdict within ", options_.verdict_timeout_ms,
                                            " ms from ",
                                            Name(pending.audit.verifiers.back())));
    }
  }
  for (const auto& [id, why] : overdue) {
    ++expired_;
    AbandonLocked(id, "audit_expired", pending_.at(id).audit.audited,
                  absl::StrCat("audit ", id, ": ", why));
  }
  // Work never handed out (a worker that stopped heartbeating) goes with
  // its audit: the queues stay bounded by the open audits.
  for (auto it = evidence_asks_.begin(); it != evidence_asks_.end();) {
    std::vector<v1::EvidenceRequest>& asks = it->second;
    asks.erase(std::remove_if(asks.begin(), asks.end(),
                              [this](const v1::EvidenceRequest& r) {
                                mu_.AssertHeld();
                                return pending_.count(r.audit_id()) == 0;
                              }),
               asks.end());
    it = asks.empty() ? evidence_asks_.erase(it) : std::next(it);
  }
  for (auto it = verify_asks_.begin(); it != verify_asks_.end();) {
    std::vector<uint64_t>& asks = it->second;
    asks.erase(std::remove_if(asks.begin(), asks.end(),
                              [this](uint64_t id) {
                                mu_.AssertHeld();
                                return pending_.count(id) == 0;
                              }),
               asks.end());
    it = asks.empty() ? verify_asks_.erase(it) : std::next(it);
  }
}

AuditFigures AuditCoordinator::Figures() const {
  AuditFigures figures;
  figures.counts = manager_.counts();
  absl::MutexLock lock(&mu_);
  figures.disputes = disputes_;
  figures.expired = expired_;
  figures.open = static_cast<int>(pending_.size());
  figures.evidence_bytes = evidence_bytes_;
  figures.evidence_bytes_total = evidence_bytes_total_;
  figures.fetched_bytes_total = fetched_bytes_total_;
  return figures;
}

bool AuditCoordinator::Disputed(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  return disputed_.count(worker_id) > 0;
}

}  // namespace geotrain
