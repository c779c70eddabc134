#include "coordinator/job_controller.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/model_profile.h"
#include "common/plan_util.h"
#include "common/update_audit_size.h"
#include "coordinator/plan_builder.h"
#include "coordinator/state_store.h"

namespace geotrain {
namespace {

constexpr size_t kThroughputWindow = 10;  // steps
// Dead workers kept (shown in status, persisted); older ones are forgotten.
constexpr size_t kMaxDeadMembers = 256;
// Workers asked to dial each joiner back, besides the coordinator.
constexpr int kPeerProbes = 2;
// How far the last stage's step reports may run ahead of stage 0's
// finished steps (ProgressGateOptions::max_lead_steps): 64 steps, or a
// twentieth of a long job (a fast model makes a hundred steps a second, and
// stage 0's reports may lag a coordinator's hiccup behind). A checkpoint's
// step may be as far past the newest step reported: its upload and the
// step's reports travel on different calls.
constexpr int kProgressLeadSteps = 64;
int ProgressLeadSteps(const v1::JobSpec& job) {
  return std::max(kProgressLeadSteps, job.steps() / 20);
}

// JobControllerOptions::before_log_write bound to one file.
std::function<absl::Status()> LogHook(
    const std::function<absl::Status(const std::string&)>& hook, const std::string& path) {
  if (!hook) return nullptr;
  return [hook, path] { return hook(path); };
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobController>> JobController::Create(
    JobControllerOptions options) {
  if (options.clock == nullptr) {
    return absl::InvalidArgumentError("JobController needs a clock");
  }
  std::shared_ptr<const Planner> planner = options.custom_planner;
  if (planner == nullptr) {
    absl::StatusOr<std::unique_ptr<Planner>> named = MakePlannerByName(options.planner);
    if (!named.ok()) return named.status();
    planner = *std::move(named);
  }
  std::shared_ptr<CoordinatorStore> store = options.store;
  if (store == nullptr) {
    absl::StatusOr<StateStore> files = StateStore::Open(options.state_dir);
    if (!files.ok()) return files.status();
    store = std::make_shared<StateStore>(*std::move(files));
  }
  absl::StatusOr<std::unique_ptr<CheckpointStore>> checkpoints =
      CheckpointStore::Open(options.state_dir);
  if (!checkpoints.ok()) return checkpoints.status();
  // Every coordinator of the state dir appends to one events log.
  AppendLogOptions events_log;
  events_log.path = options.state_dir + "/events.log";
  events_log.before_write = LogHook(options.before_log_write, events_log.path);
  events_log.rotate_bytes = options.events_log_rotate_bytes;
  absl::StatusOr<std::unique_ptr<AppendLog>> events_file = AppendLog::Open(std::move(events_log));
  if (!events_file.ok()) return events_file.status();
  auto controller = std::unique_ptr<JobController>(new JobController(
      std::move(options), std::move(planner), std::move(store), *std::move(checkpoints),
      *std::move(events_file)));
  absl::StatusOr<bool> recovered = controller->Recover();
  if (!recovered.ok()) return recovered.status();
  if (const double fraction = controller->options_.job.verification().fraction(); fraction > 0) {
    // A fresh key per coordinator: no worker can compute which of its
    // computations will be audited.
    absl::StatusOr<std::string> key = SpotCheckDraw::NewKey();
    if (!key.ok()) return key.status();
    absl::StatusOr<SpotCheckDraw> draw = SpotCheckDraw::Create(*std::move(key), fraction);
    if (!draw.ok()) return draw.status();
    JobController* self = controller.get();
    AuditCoordinatorOptions audits;
    audits.audits.fraction = fraction;
    audits.audits.first_audited_stage = 0;
    // Each open audit holds at most a few MiB of evidence (bounded apart,
    // max_evidence_bytes); fast steps draw many.
    audits.audits.max_open_audits = 256;
    // Updates are audited where each step is one update of each stage.
    const v1::JobSpec& job = self->options_.job;
    audits.audits.audit_updates = job.schedule() == v1::SCHEDULE_SYNC ||
                                  job.schedule() == v1::SCHEDULE_UNSPECIFIED;
    audits.audits.tied_ends = job.has_llama() && job.llama().tie_embeddings();
    for (const LayerProfile& layer : ProfileLayers(job)) {
      audits.audits.layer_parameters.push_back(layer.parameter_count);
    }
    audits.audits.bytes_per_parameter = UpdateAuditBytesPerParameter(job.optimizer());
    audits.audits.max_update_state_bytes = kMaxUpdateAuditStateBytes;
    audits.audits.update_sync_rate = UpdateSyncRate(job);
    audits.total_steps = job.steps();
    audits.clock = self->options_.clock;
    audits.events = &self->events_;
    audits.name_of = [self](const std::string& id) { return self->membership_.NameOf(id); };
    audits.evict = [self](const std::string& worker_id, const std::string& why,
                          std::optional<int> trusted_step) {
      if (self->options_.revoke_identity) {
        if (absl::Status revoked = self->options_.revoke_identity(worker_id); !revoked.ok()) {
          self->events_.Add("revoke_failed", self->membership_.NameOf(worker_id),
                            std::string(revoked.message()));
        }
      }
      self->RevokeWorker(worker_id, trusted_step);
    };
    self->audits_ = std::make_unique<AuditCoordinator>(*std::move(draw), std::move(audits));
    self->audits_->SetSuspicion([self](const std::string& id) { return self->IsSuspect(id); });
  }
  const JobControllerOptions& opts = controller->options_;
  std::unique_ptr<AppendLog> metrics_file;
  if (!opts.metrics_log_path.empty()) {
    // A recovering coordinator continues the log; a new job starts it.
    AppendLogOptions metrics_log;
    metrics_log.path = opts.metrics_log_path;
    metrics_log.truncate = !*recovered;
    metrics_log.before_write = LogHook(opts.before_log_write, metrics_log.path);
    absl::StatusOr<std::unique_ptr<AppendLog>> opened = AppendLog::Open(std::move(metrics_log));
    if (!opened.ok()) {
      return absl::UnavailableError(absl::StrCat("cannot write metrics log: ",
                                                 opened.status().message()));
    }
    metrics_file = *std::move(opened);
  }
  std::unique_ptr<TensorBoardWriter> curves;
  if (!opts.tensorboard_dir.empty()) {
    absl::StatusOr<std::unique_ptr<TensorBoardWriter>> opened =
        TensorBoardWriter::Open(opts.tensorboard_dir);
    if (!opened.ok()) return opened.status();
    curves = *std::move(opened);
    GT_LOG(Info) << "TensorBoard curves: " << curves->path();
  }
  controller->progress_.SetMetrics(
      std::make_unique<MetricsSink>(std::move(metrics_file), kThroughputWindow, std::move(curves)));
  if (!*recovered) controller->events_.Add("started", "", absl::StrCat("job ", opts.job.name()));
  controller->Persist();
  return controller;
}

JobController::JobController(JobControllerOptions options, std::shared_ptr<const Planner> planner,
                             std::shared_ptr<CoordinatorStore> store,
                             std::unique_ptr<CheckpointStore> checkpoints,
                             std::unique_ptr<AppendLog> events_file)
    : options_(std::move(options)),
      planner_(std::move(planner)),
      start_ms_(options_.clock->NowMs()),
      membership_(options_.clock, options_.job.lease_ms()),
      store_(std::move(store)),
      // The state is snapshotted on the writer's thread: Persist costs O(1).
      state_writer_(std::make_unique<DurableStateWriter>(
          [this](const v1::CoordinatorState& progress) { return WriteState(progress); },
          [this] { return ProgressSnapshot(); })),
      publisher_(std::make_unique<PlanPublisher>([&] {
        PlanPublisherOptions publisher;
        publisher.store = store_.get();
        // The members a plan names (and the id counter) reach the store
        // before the plan does: a restart must not find a plan naming a
        // worker its state has never heard of.
        publisher.before_write = [writer = state_writer_.get()] { writer->Flush(); };
        return publisher;
      }())),
      checkpoints_(std::move(checkpoints)),
      events_([&] {
        EventLogOptions events;
        events.clock = options_.clock;
        events.start_ms = start_ms_;
        events.file = std::move(events_file);
        return events;
      }()),
      reachability_(&membership_, kPeerProbes),
      progress_([&] {
        ProgressTrackerOptions progress;
        progress.job = &options_.job;
        progress.clock = options_.clock;
        progress.start_ms = start_ms_;
        progress.membership = &membership_;
        progress.plan = &plan_view_;
        progress.events = &events_;
        progress.persist = [this] { Persist(); };
        progress.lead_steps = ProgressLeadSteps(options_.job);
        progress.max_suspects = 4 * kMaxDeadMembers;
        progress.on_pipeline_loss = [this](int pipeline, double loss) {
          if (std::optional<std::string> change = losses_.Record(pipeline, loss)) {
            events_.Add(change->empty() ? "loss_jump_cleared" : "loss_jump", "",
                        change->empty() ? absl::StrCat("pipeline ", pipeline,
                                                       "'s loss is back among the others'")
                                        : *change);
          }
        };
        return progress;
      }()),
      checkpoint_gate_([&] {
        CheckpointGateOptions gate;
        gate.job = &options_.job;
        gate.store = checkpoints_.get();
        gate.plan = &plan_view_;
        gate.membership = &membership_;
        gate.progress = &progress_.gate();
        gate.events = &events_;
        gate.lead_steps = kProgressLeadSteps;
        return gate;
      }()),
      faults_([&] {
        FaultResponderOptions faults;
        faults.clock = options_.clock;
        faults.membership = &membership_;
        faults.progress = &progress_;
        faults.reachability = &reachability_;
        faults.events = &events_;
        faults.total_steps = options_.job.steps();
        faults.authenticated_callers = options_.authenticated_callers;
        faults.stragglers = options_.stragglers;
        faults.events_per_s = options_.events_per_s;
        faults.event_burst = options_.event_burst;
        faults.max_buckets = 4 * kMaxDeadMembers;
        return faults;
      }()),
      plans_(
          [&] {
            PlanManagerOptions plans;
            plans.job = options_.job;
            plans.clock = options_.clock;
            plans.planner = options_.planner;
            plans.max_dead_members = kMaxDeadMembers;
            plans.heartbeat_ms = options_.heartbeat_ms;
            plans.max_planner_candidates = options_.max_planner_candidates;
            return plans;
          }(),
          [&] {
            PlanManagerParts parts;
            parts.planner = planner_.get();
            parts.membership = &membership_;
            parts.network = &network_;
            parts.progress = &progress_;
            parts.reachability = &reachability_;
            parts.events = &events_;
            parts.checkpoints = checkpoints_.get();
            parts.plan_view = &plan_view_;
            parts.publisher = publisher_.get();
            parts.faults = &faults_;
            parts.persist = [this] { Persist(); };
            return parts;
          }()),
      status_([&] {
        StatusSources sources;
        sources.job = &options_.job;
        sources.clock = options_.clock;
        sources.start_ms = start_ms_;
        sources.membership = &membership_;
        sources.plan = &plan_view_;
        sources.progress = &progress_;
        sources.network = &network_;
        sources.events = &events_;
        sources.checkpoints = checkpoints_.get();
        sources.checkpoint_gate = &checkpoint_gate_;
        sources.norms = &norms_;
        sources.audits = [this] { return static_cast<const AuditCoordinator*>(audits_.get()); };
        sources.facts = [this](const std::vector<std::string>& ids) { return plans_.Facts(ids); };
        return sources;
      }()) {}

absl::StatusOr<bool> JobController::Recover() {
  absl::StatusOr<std::optional<v1::CoordinatorState>> state = store_->ReadState();
  if (!state.ok()) return state.status();
  absl::StatusOr<std::optional<v1::Plan>> plan = store_->ReadPlan();
  if (!plan.ok()) return plan.status();
  if (!state->has_value()) return false;
  const v1::CoordinatorState& saved = **state;
  std::vector<WorkerRecord> records;
  int live = 0;
  for (const v1::PersistedMember& m : saved.members()) {
    WorkerRecord& r = records.emplace_back();
    r.id = m.id();
    r.name = m.name();
    r.address = m.address();
    r.device = m.device();
    r.join_order = m.join_order();
    r.alive = m.alive();
    r.end_reason = m.end_reason();
    r.role = m.role() == v1::MEMBER_ROLE_UNSPECIFIED ? v1::MEMBER_ROLE_WORKER : m.role();
    r.reachability = m.reachability();
    live += r.alive ? 1 : 0;
  }
  membership_.Restore(std::move(records), saved.next_worker_number());
  progress_.Restore(saved, plan->has_value());
  plans_.Restore(*plan, saved.done());
  std::string layers;
  for (const auto& [layer, steps] : checkpoints_->Index()) {
    if (!steps.empty()) absl::StrAppend(&layers, layers.empty() ? "" : ", ", layer, "@", steps.back());
  }
  events_.Add("recovered", "",
              absl::StrCat("from ", store_->Describe(), ": epoch ",
                           plan->has_value() ? (*plan)->epoch() : 0, ", step ",
                           progress_.committed_step(), ", ", live,
                           " workers expected back, checkpoints (layer@step) ",
                           layers.empty() ? "none" : layers));
  return true;
}

JobController::~JobController() {
  // Their threads finish what is pending while every part they read is
  // still here: the publisher first (it flushes the writer), then the
  // writer (its snapshot reads the members, the progress and the plan's
  // end).
  publisher_.reset();
  state_writer_.reset();
}

void JobController::Persist() { state_writer_->MarkDirty(); }

v1::CoordinatorState JobController::ProgressSnapshot() const {
  v1::CoordinatorState progress;
  progress_.FillState(&progress);
  progress.set_done(plans_.done());
  return progress;
}

absl::Status JobController::WriteState(const v1::CoordinatorState& progress) {
  // Read before the copy: a change in between is in the copy and is
  // written again next time, never missed.
  const uint64_t version = membership_.persisted_version();
  if (written_members_version_ != version) {
    v1::CoordinatorState members;
    FillPersistedMembers(members.mutable_members());
    members.set_next_worker_number(membership_.next_number());
    if (absl::Status written = store_->WriteMembers(members); !written.ok()) return written;
    written_members_version_ = version;
  }
  return store_->WriteProgress(progress);
}

void JobController::FillPersistedMembers(
    google::protobuf::RepeatedPtrField<v1::PersistedMember>* members) const {
  for (const WorkerRecord& w : membership_.Snapshot()) {
    v1::PersistedMember* m = members->Add();
    m->set_id(w.id);
    m->set_name(w.name);
    m->set_address(w.address);
    *m->mutable_device() = w.device;
    m->set_alive(w.alive);
    m->set_end_reason(w.end_reason);
    m->set_join_order(w.join_order);
    m->set_role(w.role);
    *m->mutable_reachability() = w.reachability;
  }
}

void JobController::FlushState() {
  publisher_->Flush();
  state_writer_->Flush();
  events_.Flush();
  progress_.Flush();
}

absl::StatusOr<v1::JoinResponse> JobController::Join(const v1::JoinRequest& request,
                                                     const std::string& worker_id,
                                                     const v1::Reachability& reachability) {
  if (absl::Status valid = ValidateJoinRequest(request); !valid.ok()) return valid;
  const bool relay = request.role() == v1::MEMBER_ROLE_RELAY;
  bool retried = false;
  WorkerRecord record =
      membership_.Join(request.name(), request.address(), request.device(), worker_id,
                       request.role(), reachability, request.session_id(), &retried);
  v1::JoinResponse response;
  response.set_worker_id(record.id);
  response.set_lease_ms(static_cast<int32_t>(membership_.lease_ms()));
  response.set_heartbeat_ms(options_.heartbeat_ms);
  *response.mutable_reachability() = record.reachability;
  if (!relay) *response.mutable_job() = options_.job;
  // A retry is answered as its first attempt was: no event, no plan.
  if (retried) return response;
  network_.Learn(record.id, record.address);
  const std::string reach =
      !reachability.known() ? "" : reachability.reachable() ? ", reachable" : ", not reachable";
  if (!relay) reachability_.AskPeersToProbe(record);
  plans_.OnJoined(record,
                  relay ? absl::StrCat(record.id, " at ", record.address, ", relay", reach)
                        : absl::StrFormat("%s at %s, %s, %.1f GFLOP/s%s", record.id,
                                          record.address, request.device().device(),
                                          request.device().matmul_gflops(), reach));
  Persist();
  return response;
}

void JobController::AbandonJoin(const std::string& worker_id, const std::string& session) {
  plans_.ForgetAbandoned(worker_id, session, [this](const std::string& forgotten) {
    network_.Forget(forgotten);
    reachability_.Forget(forgotten);
  });
}

bool JobController::KnowsWorker(const std::string& worker_id) const {
  return membership_.Knows(worker_id);
}

void JobController::RecordEnrollment(const std::string& worker_id, const std::string& name,
                                     const std::string& token_id) {
  events_.Add("enrolled", name.empty() ? worker_id : name,
              absl::StrCat(worker_id, " with token ", token_id));
}

void JobController::RecordAdminEvent(const std::string& kind, const std::string& detail) {
  events_.Add(kind, "", detail);
}

bool JobController::RevokeWorker(const std::string& worker_id,
                                 std::optional<int> trusted_step) {
  const bool was_live = membership_.Leave(worker_id, "revoked");
  // Its checkpoints are no longer trusted (disk I/O: off every lock).
  const absl::StatusOr<int> quarantined = checkpoints_->Quarantine(worker_id);
  std::optional<int> roll_back_to;
  if (trusted_step.has_value()) {
    // Nor is anything computed since the step it was last trusted at:
    // its outputs fed its pipeline's updates, and through the outer
    // optimizer every replica's (docs/verification.md, "Rollback").
    const PlanView::PlanPtr plan = plan_view_.Get();
    const absl::StatusOr<CheckpointStore::Rollback> rollback = checkpoints_->RollBackTo(
        *trusted_step, plan != nullptr ? plan->num_layers() : 0);
    if (rollback.ok()) {
      roll_back_to = rollback->step;
      if (audits_ != nullptr) audits_->RolledBack(rollback->step);
      events_.Add("checkpoints_rolled_back", membership_.NameOf(worker_id),
                  absl::StrCat("trusted up to step ", *trusted_step, ": back to step ",
                               rollback->step, "; ", rollback->moved,
                               " later checkpoint files moved into quarantine"));
    } else {
      events_.Add("rollback_failed", membership_.NameOf(worker_id),
                  std::string(rollback.status().message()));
    }
  }
  plans_.OnRevoked(worker_id, quarantined, roll_back_to);
  membership_.PruneDead(kMaxDeadMembers);
  Persist();
  return was_live;
}

bool JobController::Heartbeat(const v1::HeartbeatRequest& request,
                              v1::HeartbeatResponse* response) {
  // The service refuses these with a reason; nothing of one is kept.
  if (!ValidateHeartbeatRequest(request).ok()) return false;
  if (!membership_.Heartbeat(request.worker_id(), request.rss_bytes(), request.step(),
                             request.stats())) {
    return false;
  }
  if (request.layer_seconds_per_sample_size() > 0) {
    membership_.SetLayerTimings(request.worker_id(), request.layer_seconds_per_sample());
  }
  if (request.step() > 0) {
    progress_.FirstStageFinished(request.worker_id(), request.epoch(), request.step());
  }
  // The link matrix has a lock of its own: measurements never wait for the
  // plan's.
  const int64_t now_ms = options_.clock->NowMs();
  bool reachability_results = false;
  for (int i = 0; i < std::min(request.probe_results_size(), kPeerProbes * 4); ++i) {
    const v1::ProbeResult& result = request.probe_results(i);
    if (result.measured()) {
      network_.RecordProbe(request.worker_id(), result, now_ms);
    } else {
      reachability_results = true;
    }
  }
  for (int i = 0; i < std::min(request.stats().links_size(), 64); ++i) {
    const v1::LinkStats& link = request.stats().links(i);
    if (link.link_rate_bps() > 0) {
      network_.RecordLinkRate(request.worker_id(), link.peer(), link.link_rate_bps(), now_ms);
    }
  }
  for (int i = 0; i < std::min(request.access_probe_results_size(), 4); ++i) {
    network_.RecordAccess(request.worker_id(), request.access_probe_results(i), now_ms);
  }
  if (const PlanView::PlanPtr plan = plan_view_.Get()) {
    for (const OutputNorms& change : norms_.Record(*plan, request.worker_id(), request.epoch(),
                                                          request.stats())) {
      events_.Add(change.suspicion.empty() ? "output_norms_cleared" : "output_norms_suspect",
                  membership_.NameOf(change.worker_id),
                  change.suspicion.empty()
                      ? absl::StrCat("its ", change.kind, "s are back within bounds")
                      : change.suspicion);
    }
  }
  if (response != nullptr && network_.WantsTask(request.worker_id(), now_ms)) {
    // Shared, not copied: after a join every member may want a task.
    uint64_t generation = 0;
    const std::shared_ptr<const std::vector<WorkerRecord>> shared =
        membership_.SharedLivePeers(&generation);
    const std::vector<WorkerRecord>& live = *shared;
    if (std::optional<v1::ProbeTask> task =
            network_.NextTask(request.worker_id(), live, now_ms, generation)) {
      *response->add_probes() = *std::move(task);
    }
    if (std::optional<v1::AccessProbeTask> access =
            network_.NextAccessTask(request.worker_id(), live, now_ms, generation)) {
      *response->mutable_access_probe() = *std::move(access);
    }
  }
  if (response != nullptr) {
    for (v1::ProbeTask& task : reachability_.TakeTasks(request.worker_id())) {
      *response->add_probes() = std::move(task);
    }
    if (audits_ != nullptr) audits_->FillHeartbeat(request.worker_id(), response);
  }
  if (!reachability_results) return true;
  for (int i = 0; i < std::min(request.probe_results_size(), kPeerProbes * 4); ++i) {
    if (request.probe_results(i).measured()) continue;
    std::optional<ReachabilityManager::Verdict> verdict =
        reachability_.RecordResult(request.worker_id(), request.probe_results(i));
    if (verdict.has_value() && verdict->changed) plans_.OnReachabilityChanged(*verdict);
  }
  return true;
}

void JobController::Leave(const std::string& worker_id) {
  if (!membership_.Leave(worker_id, "left")) return;
  network_.Forget(worker_id);
  reachability_.Forget(worker_id);
  norms_.Forget(worker_id);
  plans_.OnLeft(worker_id);
  membership_.PruneDead(kMaxDeadMembers);
  Persist();
}

PlanPublisher::PlanPtr JobController::WaitForPlan(uint64_t after_epoch,
                                                  absl::Duration timeout) const {
  return publisher_->WaitForNewer(after_epoch, timeout);
}

absl::Status JobController::ReportStep(const v1::StepReport& report) {
  absl::Status status = progress_.ReportStep(report);
  if (status.ok()) DrawAudits();
  return status;
}

void JobController::DrawAudits() {
  if (audits_ == nullptr) return;
  const PlanView::PlanPtr plan = plan_view_.Get();
  const int committed = progress_.committed_step();
  // Nothing new committed (most ticks): no copy of the members.
  if (plan == nullptr || committed == audited_through_.exchange(committed)) return;
  audits_->OnCommitted(*plan, committed, options_.job.microbatches(), Standbys(*plan));
  // What a rollback would go back to stays on disk.
  checkpoints_->PinAtOrBefore(audits_->TrustedFloor());
}

bool JobController::IsSuspect(const std::string& worker_id) const {
  if (!norms_.SuspicionOf(worker_id).empty()) return true;
  const PlanView::PlanPtr plan = plan_view_.Get();
  int index = 0;
  const v1::StageAssignment* stage = plan != nullptr ? StageOf(*plan, worker_id, &index) : nullptr;
  if (stage == nullptr) return false;
  return !losses_.SuspicionOf(WorkersOf(*stage)[index].pipeline).empty();
}

std::vector<std::string> JobController::Standbys(const v1::Plan& plan) const {
  // Verifiers after the other pipelines' workers of the stage (with two
  // pipelines, the second verifier of an audit is a standby). A few are
  // plenty: the draw picks among them.
  constexpr size_t kMaxStandbyVerifiers = 16;
  std::vector<std::string> standbys;
  const std::set<std::string> in_plan = [&] {
    std::set<std::string> ids;
    for (const v1::StageAssignment& stage : plan.stages()) {
      ids.insert(stage.worker_id());
      for (const v1::Replica& r : stage.replicas()) ids.insert(r.worker_id());
    }
    return ids;
  }();
  // The shared snapshot the heartbeats use: no copy of the members per
  // committed step.
  const std::shared_ptr<const std::vector<WorkerRecord>> live = membership_.SharedLivePeers();
  for (const WorkerRecord& w : *live) {
    if (in_plan.count(w.id) == 0) standbys.push_back(w.id);
    if (standbys.size() >= kMaxStandbyVerifiers) break;
  }
  return standbys;
}

absl::Status JobController::AcceptAuditEvidence(const std::string& caller,
                                                const v1::AuditEvidence& evidence) {
  if (audits_ == nullptr) return absl::FailedPreconditionError("this job runs no spot checks");
  return audits_->AcceptEvidence(caller, evidence);
}

absl::StatusOr<v1::AuditBundle> JobController::FetchAudit(const std::string& caller,
                                                          uint64_t audit_id) const {
  if (audits_ == nullptr) return absl::FailedPreconditionError("this job runs no spot checks");
  return audits_->Fetch(caller, audit_id);
}

absl::Status JobController::AcceptAuditVerdict(const std::string& caller,
                                               const v1::AuditVerdict& verdict) {
  if (audits_ == nullptr) return absl::FailedPreconditionError("this job runs no spot checks");
  const PlanView::PlanPtr plan = plan_view_.Get();
  if (plan == nullptr) return absl::FailedPreconditionError("no plan");
  return audits_->AcceptVerdict(caller, verdict, *plan, Standbys(*plan));
}

absl::Status JobController::ReportEval(const v1::EvalReport& report) {
  return progress_.ReportEval(report);
}

absl::Status JobController::ReportDone(const v1::DoneReport& report) {
  absl::StatusOr<bool> all_done = progress_.ReportDone(report);
  if (!all_done.ok()) return all_done.status();
  if (*all_done) plans_.FinishJob();
  return absl::OkStatus();
}

absl::Status JobController::RecordWorkerEvent(const v1::WorkerEvent& event) {
  // The rate and the log first, off the plan's lock: a flood of events
  // never reaches it.
  if (absl::Status admitted = faults_.Admit(event); !admitted.ok()) return admitted;
  return plans_.OnWorkerEvent(event);
}

void JobController::Tick() {
  const std::vector<WorkerRecord> expired = membership_.ExpireLeases();
  for (const WorkerRecord& w : expired) {
    network_.Forget(w.id);
    reachability_.Forget(w.id);
  }
  plans_.Tick(expired);
  progress_.WriteStageCurves(/*job_done=*/false);
  if (audits_ != nullptr) {
    DrawAudits();
    audits_->Expire();
  }
  if (!expired.empty()) {
    membership_.PruneDead(kMaxDeadMembers);
    Persist();
  }
}

ProgressHistory JobController::History() const { return progress_.History(); }

v1::ClusterStatus JobController::Status() const {
  return *Status(v1::ClusterStatusRequest());  // the defaults are valid
}

absl::StatusOr<v1::ClusterStatus> JobController::Status(
    const v1::ClusterStatusRequest& request) const {
  return status_.Assemble(request);
}

bool JobController::done() const { return plans_.done(); }

bool JobController::shutting_down() const { return shutdown_; }

void JobController::Shutdown() {
  shutdown_ = true;
  publisher_->Shutdown();
}

}  // namespace geotrain
