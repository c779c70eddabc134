// The coordinator of one job, as a composition root: it makes the parts
// and routes each call to the part that owns it.
//   - Membership: who has joined, and their leases.
//   - ReachabilityManager: peer probes and relays.
//   - FaultResponder: who leaves the plan for a broken link, a straggler
//     or a stall, and who may stand by or replicate.
//   - PlanManager: the plan's lifecycle; it carries out those decisions.
//   - PlanPublisher: plans durable (CoordinatorStore), then visible.
//   - ProgressTracker: step, evaluation and done reports; the metrics log.
//   - CheckpointGate: who may save and load which checkpoints.
//   - StatusAssembler: the status, paginated.
//   - AuditCoordinator: spot checks of the stages' computations, when the
//     job sets verification.fraction.
// Each part has its own lock (or none); no call holds one part's lock
// while it waits on the store, and heartbeats take no lock of the plan.
// It knows nothing of gRPC; the service adapters in coordinator_service.h
// call it.
//
// Thread-safe: every public method may be called from any thread.
#ifndef GEOTRAIN_COORDINATOR_JOB_CONTROLLER_H_
#define GEOTRAIN_COORDINATOR_JOB_CONTROLLER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/audit_coordinator.h"
#include "coordinator/checkpoint_gate.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/coordinator_store.h"
#include "coordinator/durable_state_writer.h"
#include "coordinator/event_log.h"
#include "coordinator/fault_responder.h"
#include "coordinator/loss_jump_watch.h"
#include "coordinator/membership.h"
#include "coordinator/metrics_sink.h"
#include "coordinator/network_matrix.h"
#include "coordinator/network_planner.h"
#include "coordinator/output_norm_watch.h"
#include "coordinator/plan_manager.h"
#include "coordinator/plan_publisher.h"
#include "coordinator/plan_view.h"
#include "coordinator/progress_tracker.h"
#include "coordinator/reachability_manager.h"
#include "coordinator/status_assembler.h"
#include "coordinator/straggler_detector.h"
#include "geotrain/v1/audit.pb.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct JobControllerOptions {
  v1::JobSpec job;               // validated, defaults applied
  std::string state_dir;         // required
  std::string metrics_log_path;  // one JSON line per step/eval; empty: none
  // TensorBoard event files of the same figures (TensorBoardWriter);
  // empty: none.
  std::string tensorboard_dir;
  const Clock* clock = nullptr;  // not owned; must outlive the controller
  int heartbeat_ms = 1000;
  // Callers' worker ids are certified (TLS): an accuser whose accusations
  // are not confirmed can be suspected. Insecure, anyone may speak for
  // anyone, so nobody is suspected on what "they" said.
  bool authenticated_callers = false;
  // "network" (coordinator/network_planner.h) or "join-order" (planner v1:
  // join order, compute-only cuts).
  std::string planner = "network";
  // A planner of the caller's instead of `planner` by name (tests: one
  // that blocks mid-search).
  std::shared_ptr<const Planner> custom_planner;
  // The most workers one search considers (PlanManagerOptions).
  size_t max_planner_candidates = 1000;
  // When a slow stage's worker is swapped for a standby
  // (StragglerDetector); patience_ms INT64_MAX: never.
  StragglerOptions stragglers;
  // Where the plan and the state are kept (tests pass an in-memory store,
  // or one that stalls or fails). Empty: the files of state_dir
  // (StateStore). The checkpoints and the events log are in state_dir
  // either way.
  std::shared_ptr<CoordinatorStore> store;
  // The same for each batch of lines appended to the events log and the
  // metrics log (AppendLog), given the file's path. Empty: none.
  std::function<absl::Status(const std::string& path)> before_log_write;
  // events.log is rotated to events.log.1 past this size (AppendLog), so
  // it holds at most twice this on disk.
  uint64_t events_log_rotate_bytes = uint64_t{64} << 20;
  // What one worker may report through RecordWorkerEvent: a bucket of
  // `event_burst` events that refills at `events_per_s`.
  double events_per_s = 2;
  double event_burst = 20;
  // Denies a worker's certificate from now on (AccessStore::RevokeWorker):
  // what a confirmed spot-check mismatch does besides ending its lease.
  // Empty (insecure): the lease ends, and the worker may join again.
  std::function<absl::Status(const std::string& worker_id)> revoke_identity;
};

class JobController {
 public:
  static absl::StatusOr<std::unique_ptr<JobController>> Create(
      JobControllerOptions options);
  ~JobController();

  // INVALID_ARGUMENT for a join whose fields are out of range
  // (ValidateJoinRequest). `worker_id`: the caller's certified id (TLS),
  // or empty for a new id (insecure).
  // `reachability`: what the coordinator found dialling the joiner back
  // (ReachabilityProber); it decides who dials each of its links. Not
  // known (not probed): taken as reachable.
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request,
                                        const std::string& worker_id = "",
                                        const v1::Reachability& reachability = v1::Reachability());
  // The caller of a join gave up before the answer (its RPC was
  // cancelled): the member it created is forgotten, unless a retry of the
  // same session was answered with it or a plan names it already.
  void AbandonJoin(const std::string& worker_id, const std::string& session);
  bool KnowsWorker(const std::string& worker_id) const;
  // Waits until the plan, state, events and metrics submitted so far are
  // durable (step reports and joins never wait for them; see PlanPublisher,
  // DurableStateWriter and AppendLog).
  void FlushState();
  // Events for the Admin service and enrollments (TLS mode).
  void RecordEnrollment(const std::string& worker_id, const std::string& name,
                        const std::string& token_id);
  void RecordAdminEvent(const std::string& kind, const std::string& detail);
  // Ends a revoked worker's lease now (re-planning around it). True when it was live.
  // With `trusted_step` (a confirmed wrong computation: its computations
  // are trusted up to that step), the job also rolls back: the checkpoints
  // go back to the newest step at or before it that every layer has
  // (CheckpointStore::RollBackTo), and so does the next plan
  // (PlanManager::OnRevoked).
  bool RevokeWorker(const std::string& worker_id,
                    std::optional<int> trusted_step = std::nullopt);
  // False when the worker is unknown or dead (it must join again).
  // `response` (when given) gets the probes this worker is asked to make;
  // the request's results count only for probes it was asked to make.
  bool Heartbeat(const v1::HeartbeatRequest& request,
                 v1::HeartbeatResponse* response = nullptr);
  void Leave(const std::string& worker_id);

  // Blocks until a plan with an epoch above `after_epoch` is visible or
  // `timeout` passes (null). A plan is visible once it is durable
  // (PlanPublisher), so shortly after the call that decided it returns. A
  // plan with job_done ends the watch.
  PlanPublisher::PlanPtr WaitForPlan(uint64_t after_epoch, absl::Duration timeout) const;
  // The newest visible plan (null before the first), and a listener called
  // with each plan made visible from now on, on the publisher's thread.
  PlanPublisher::PlanPtr VisiblePlan() const { return publisher_->Visible(); }
  void AddPlanListener(PlanPublisher::Listener listener) {
    publisher_->AddListener(std::move(listener));
  }

  // Refuses reports of another epoch or of a step that is not new
  // (FAILED_PRECONDITION), of workers the plan does not put on the last
  // stage (PERMISSION_DENIED; ReportDone: on any stage), and of figures out
  // of range: a step past the job's, a loss that is not finite
  // (INVALID_ARGUMENT).
  absl::Status ReportStep(const v1::StepReport& report);
  absl::Status ReportEval(const v1::EvalReport& report);
  absl::Status ReportDone(const v1::DoneReport& report);

  // Who may save and load which checkpoints (thread-safe; it takes no lock
  // of the controller).
  CheckpointGate& checkpoint_gate() { return checkpoint_gate_; }
  CheckpointStore& checkpoints() { return *checkpoints_; }
  const v1::JobSpec& job() const { return options_.job; }
  const std::string& state_dir() const { return options_.state_dir; }
  // A worker's report (restore, drain, dropped microbatches, dead link).
  // A link_lost report counts only from a neighbour of the accused in the
  // current plan (else PERMISSION_DENIED with an event), once per link and
  // epoch; LinkFaultLedger decides which end leaves the pipeline, and
  // which is excluded from plans for a while.
  absl::Status RecordWorkerEvent(const v1::WorkerEvent& event);

  // Spot checks (AuditCoordinator): a worker's evidence, the audit its
  // verifier fetches, and the verdict. FAILED_PRECONDITION when the job
  // runs none.
  absl::Status AcceptAuditEvidence(const std::string& caller, const v1::AuditEvidence& evidence);
  absl::StatusOr<v1::AuditBundle> FetchAudit(const std::string& caller, uint64_t audit_id) const;
  absl::Status AcceptAuditVerdict(const std::string& caller, const v1::AuditVerdict& verdict);

  // Expires leases, re-plans around lost workers (a standby takes an
  // orphaned stage; without one the layers are re-partitioned over the
  // survivors) and plans when enough workers are live. Call periodically.
  void Tick();

  // Paginated and filtered (StatusAssembler); INVALID_ARGUMENT for a bad
  // page token or filter.
  absl::StatusOr<v1::ClusterStatus> Status(const v1::ClusterStatusRequest& request) const;
  // The first page of the default size: every member of any job so far.
  v1::ClusterStatus Status() const;
  // The steps' losses and throughput and the evaluations so far (bounded).
  ProgressHistory History() const;
  bool done() const;
  bool shutting_down() const;
  // Wakes every WaitForPlan caller; later calls return at once.
  void Shutdown();

 private:
  JobController(JobControllerOptions options, std::shared_ptr<const Planner> planner,
                std::shared_ptr<CoordinatorStore> store,
                std::unique_ptr<CheckpointStore> checkpoints,
                std::unique_ptr<AppendLog> events_file);
  // Draws the audits of the steps committed since the last call.
  void DrawAudits();
  // A worker the cheap checks suspect: its outputs' norms, or its
  // pipeline's loss.
  bool IsSuspect(const std::string& worker_id) const;
  // Standbys: verifiers when no other pipeline holds the stage.
  std::vector<std::string> Standbys(const v1::Plan& plan) const;
  // Takes over what a previous coordinator persisted in the store. True
  // when there was something.
  absl::StatusOr<bool> Recover();
  // The state changed: the writer writes it (WriteState) on its own
  // thread. O(1); needs no lock.
  void Persist();
  // The progress and the job's end, as the store keeps them.
  v1::CoordinatorState ProgressSnapshot() const;
  // On the state writer's thread only: writes the members if they changed
  // since they were last written, then `progress`. A committed step costs
  // the progress alone; a copy of 10,000 members under Membership's lock
  // per step stalled the heartbeats, and printing them took a core.
  absl::Status WriteState(const v1::CoordinatorState& progress);
  void FillPersistedMembers(
      google::protobuf::RepeatedPtrField<v1::PersistedMember>* members) const;

  const JobControllerOptions options_;
  const std::shared_ptr<const Planner> planner_;
  const int64_t start_ms_;
  // The parts, each thread-safe itself with its own lock (or none); in
  // the order they are made, as the later ones read the earlier.
  NetworkMatrix network_;
  Membership membership_;
  const std::shared_ptr<CoordinatorStore> store_;
  // Write the state and the plans off every lock, each on its own thread;
  // a plan reaches the workers once it is durable, and after the state
  // that names its members.
  // The Membership version the store's members are of (the state writer's
  // thread only; declared before the writer, which uses it until it
  // stops). Nothing is written yet at first.
  std::optional<uint64_t> written_members_version_;
  std::unique_ptr<DurableStateWriter> state_writer_;
  std::unique_ptr<PlanPublisher> publisher_;  // after state_writer_: it flushes that
  const std::unique_ptr<CheckpointStore> checkpoints_;
  EventLog events_;
  ReachabilityManager reachability_;
  PlanView plan_view_;  // the plan decided, for readers
  OutputNormWatch norms_;  // the cheap check on every microbatch
  LossJumpWatch losses_;   // ... and on every pipeline's loss
  ProgressTracker progress_;
  CheckpointGate checkpoint_gate_;
  FaultResponder faults_;
  PlanManager plans_;
  StatusAssembler status_;
  // Null when the job runs no spot checks; made by Create (its key comes
  // from the CSPRNG, which can fail).
  std::unique_ptr<AuditCoordinator> audits_;
  std::atomic<int> audited_through_{0};  // the committed step DrawAudits last saw
  std::atomic<bool> shutdown_{false};
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_JOB_CONTROLLER_H_
