// The coordinator's brain for one job: admits workers (Membership), plans
// once enough have joined (Planner), publishes plans with epochs, records
// progress to the metrics log and answers status queries. It knows nothing
// of gRPC; the service adapters in coordinator_service.h call it.
//
// Thread-safe: every public method may be called from any thread.
#ifndef GEOTRAIN_COORDINATOR_JOB_CONTROLLER_H_
#define GEOTRAIN_COORDINATOR_JOB_CONTROLLER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/link_fault_ledger.h"
#include "coordinator/checkpoint_gate.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/coordinator_store.h"
#include "coordinator/durable_state_writer.h"
#include "coordinator/event_log.h"
#include "coordinator/membership.h"
#include "coordinator/metrics_sink.h"
#include "coordinator/network_matrix.h"
#include "coordinator/network_planner.h"
#include "coordinator/pipeline_continuity.h"
#include "coordinator/plan_publisher.h"
#include "coordinator/plan_view.h"
#include "coordinator/progress_tracker.h"
#include "coordinator/reachability_manager.h"
#include "coordinator/replan_policy.h"
#include "coordinator/status_assembler.h"
#include "coordinator/straggler_detector.h"
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
};

class JobController {
 public:
  static absl::StatusOr<std::unique_ptr<JobController>> Create(
      JobControllerOptions options);

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
  bool RevokeWorker(const std::string& worker_id);
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
  JobController(JobControllerOptions options, std::unique_ptr<Planner> planner,
                std::shared_ptr<CoordinatorStore> store,
                std::unique_ptr<DurableStateWriter> state_writer,
                std::unique_ptr<CheckpointStore> checkpoints,
                std::unique_ptr<AppendLog> events_file);
  // Takes over what a previous coordinator persisted in the state dir.
  absl::Status RecoverLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  double ElapsedS() const;
  void MaybePlanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReplanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Several pipelines, the job's step stalled: true when another pipeline
  // still moves (then only a pipeline that alone stood still past the
  // start-up grace is taken out), false when none does.
  bool CheckPipelinesProgressLocked(const ProgressTracker::Pace& pace, int64_t now,
                                    int64_t limit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A plan of several pipelines where a worker outside `live` left: a
  // standby takes its place or its pipeline is dissolved (pipeline_repair.h).
  // False when nothing changed.
  bool RepairPipelinesLocked(std::set<std::string> live, const std::string& why = "")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With the outer optimizer: enough standbys (one per stage) form another
  // pipeline at the plan's cuts (up to outer.max_pipelines); the pipelines
  // there are go on (pipeline_continuity.h). Under the network planner only
  // where it would now choose more pipelines. False when none formed.
  bool MaybeFormPipelineLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The network planner's input over `candidates` while a plan runs: the
  // measured links and ports, replica eligibility, and the layer timings
  // calibrated by the stages' measured compute.
  PlannerInput LivePlannerInputLocked(const std::vector<WorkerRecord>& candidates) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The network planner's R over the plan's workers and `spares` exceeds
  // the plan's (at most once per re-plan interval; an event says so).
  bool NetworkWantsMorePipelinesLocked(const std::vector<WorkerRecord>& spares)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new partition over the eligible workers of `live` (the event says
  // `why` first), or waiting when there are none.
  void RepartitionLocked(const std::set<std::string>& live, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How ReplaceLocked treats the worker it replaces.
  enum class Replacement {
    // Out of the plan (a lost link, a demoted replica): a replica just
    // leaves its stage; a primary with replicas hands the stage to the
    // first of them; a stage's only worker goes to a standby, or with none
    // the same stages get a new epoch (new links).
    kTakeOut,
    // A standby that was never demoted takes exactly this worker's place
    // (a straggler); nothing happens without one.
    kSwapWithStandby,
  };
  // True when a plan was published.
  bool ReplaceLocked(const std::string& worker_id, const std::string& why, Replacement how)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reports a stage far slower per microbatch than every other stage, whose
  // worker has also slowed down well below its own best pace, and hands it
  // to a standby when there is one; a replica far slower than its fastest
  // sibling is reported and demoted to standby.
  void CheckStragglersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool EligibleStandbyLocked(const WorkerRecord& worker) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Live workers outside `plan` that may take a stage, fastest first.
  std::vector<WorkerRecord> StandbysLocked(const v1::Plan& plan) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a worker may become a replica: not a demoted straggler, and not
  // one taken out for a lost link within the last kReplicaCooldownMs.
  bool MayReplicateLocked(const std::string& worker_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets PlannerWorkerInfo::may_replicate from MayReplicateLocked.
  void MarkReplicaCandidatesLocked(PlannerInput* input) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives the stages of `plan` but the last standbys as replicas (middle
  // stages first, then stage 0) until each has
  // job.replicas workers (never a worker demoted as a straggler). True when
  // it added one. Join order only: the network planner chooses replicas.
  bool FillReplicasLocked(v1::Plan* plan, std::string* summary) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes `next` as the following epoch, resuming after the last step.
  void PublishReplanLocked(v1::Plan next, const std::string& summary)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stages over `live` as the planner partitions them; nullopt (and an
  // event) when it cannot.
  std::optional<v1::Plan> PartitionLocked(const std::vector<WorkerRecord>& live,
                                          std::string* summary)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Submits the state (members, progress, done) to the writer; needs no
  // lock of the controller.
  void Persist();
  void PublishLocked(v1::Plan plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fills plan->links (AssignLinks over the members' reachability and the
  // usable relays); a link no one can dial is an event.
  void AssignLinksLocked(v1::Plan* plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same stages with links assigned anew (a relay came or went).
  void RelinkLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_ so that events keep the order of the changes they describe.
  void AddEventLocked(const std::string& kind, const std::string& worker,
                      const std::string& detail)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NameOf(const std::string& worker_id) const;
  // The epoch of the current plan's link between `reporter` and `peer`.
  uint64_t LinkEpochOfLocked(const std::string& reporter, const std::string& peer) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the current plan's pipelines have drawn of the data.
  PipelineDataInput DataInputLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobControllerOptions options_;
  const std::unique_ptr<Planner> planner_;
  NetworkMatrix network_;  // thread-safe itself
  const int64_t start_ms_;
  Membership membership_;

  mutable absl::Mutex mu_;
  const std::shared_ptr<CoordinatorStore> store_;  // thread-safe itself
  // Write the state and the plans off every lock, each on its own thread;
  // a plan reaches the workers once it is durable, and after the state
  // that names its members. Events and metrics go through AppendLog's
  // thread (events_, metrics_).
  std::unique_ptr<DurableStateWriter> state_writer_;
  std::unique_ptr<PlanPublisher> publisher_;  // after state_writer_: it flushes that
  const std::unique_ptr<CheckpointStore> checkpoints_;  // thread-safe itself
  bool recovered_ ABSL_GUARDED_BY(mu_) = false;
  bool waiting_for_workers_ ABSL_GUARDED_BY(mu_) = false;
  // Workers taken out of a plan for a lost link, and when.
  std::map<std::string, int64_t> suspended_at_ms_ ABSL_GUARDED_BY(mu_);
  // Workers handing their stage over (their links close on purpose).
  std::set<std::string> draining_ ABSL_GUARDED_BY(mu_);
  StragglerDetector stragglers_ ABSL_GUARDED_BY(mu_);
  // The progress watchdog: when no step is committed for long (see the
  // .cc), it follows whom the workers wait on to the stalled one (or takes
  // stage 0, when nobody is owed anything) and re-plans around it.
  void CheckProgressLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A broken (or stalled) link between `reporter` and `accused`: the
  // LinkFaultLedger's verdict takes one of them out. `how`: "was lost".
  void TakeOutForBrokenLinkLocked(const std::string& reporter, const std::string& accused,
                                  const char* how) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each worker's event rate (RecordWorkerEvent).
  struct EventBucket {
    double tokens = 0;
    int64_t at_ms = 0;
  };
  std::map<std::string, EventBucket> event_buckets_ ABSL_GUARDED_BY(mu_);
  // Workers demoted as stragglers: standbys, but never made replicas again.
  std::set<std::string> demoted_ ABSL_GUARDED_BY(mu_);
  // Broken links and whom they take out (coordinator/link_fault_ledger.h).
  LinkFaultLedger link_faults_ ABSL_GUARDED_BY(mu_);
  // A worker the link faults exclude: no stage, no standby place.
  bool ExcludedLocked(const std::string& worker_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<v1::Plan> plan_ ABSL_GUARDED_BY(mu_);
  // What the planner predicted when it last partitioned the layers.
  v1::PlanPrediction prediction_ ABSL_GUARDED_BY(mu_);
  // Network planner: re-run on fresh figures every 30 s; a better plan is
  // taken when it is worth the move (coordinator/replan_policy.h).
  ReplanPolicy replan_policy_ ABSL_GUARDED_BY(mu_);
  int last_replan_verdict_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t last_replan_event_ms_ ABSL_GUARDED_BY(mu_) = 0;
  void MaybeVoluntaryReplanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // Written under mu_; read without it (Persist).
  std::atomic<bool> done_{false};
  EventLog events_;  // thread-safe itself
  ReachabilityManager reachability_;  // thread-safe itself
  // The plan decided (plan_), for readers that take no lock of ours.
  PlanView plan_view_;
  // Reports, committed figures, the metrics log (thread-safe itself).
  ProgressTracker progress_;
  CheckpointGate checkpoint_gate_;  // after what it reads
  StatusAssembler status_;          // after everything it reads
  // The status's facts only the controller keeps (under mu_).
  ControllerFacts FactsFor(const std::vector<std::string>& ids) const;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_JOB_CONTROLLER_H_
