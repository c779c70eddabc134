// The plan's lifecycle: the first plan once enough workers have joined,
// re-plans around lost and revoked workers (a standby takes an orphaned
// stage; without one the layers are re-partitioned over the survivors),
// replicas filled, pipelines repaired and formed, voluntary moves to a
// better plan, and carrying out what the FaultResponder decides about
// broken links, stragglers and stalls.
//
// It owns the decided plan and its lock. It does no I/O: each plan it
// decides goes to the PlanView (readers) and the PlanPublisher (which
// makes it durable, then visible, on its own thread), and state changes
// are handed to `persist` (DurableStateWriter's queue). Heartbeats never
// take its lock; only events that may change the plan do (a join, a loss,
// a worker's report of a broken link, the periodic Tick). Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_PLAN_MANAGER_H_
#define GEOTRAIN_COORDINATOR_PLAN_MANAGER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/event_log.h"
#include "coordinator/fault_responder.h"
#include "coordinator/membership.h"
#include "coordinator/network_matrix.h"
#include "coordinator/network_planner.h"
#include "coordinator/pipeline_continuity.h"
#include "coordinator/plan_publisher.h"
#include "coordinator/plan_view.h"
#include "coordinator/progress_tracker.h"
#include "coordinator/reachability_manager.h"
#include "coordinator/replan_policy.h"
#include "coordinator/status_assembler.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

struct PlanManagerOptions {
  v1::JobSpec job;
  const Clock* clock = nullptr;  // not owned
  // "network" or "join-order" (the planner's name; JobControllerOptions).
  std::string planner = "network";
  // Dead members kept (status, state); older ones are forgotten.
  size_t max_dead_members = 256;
  // The workers' heartbeat period: a standby not heard from in two of them
  // is taken only after those that were (it may be dying with the others).
  int heartbeat_ms = 1000;
  // The most workers one planner search considers: the plan's members
  // first, then the standbys heard from lately, fastest first. The search
  // and its input (a link for every pair) grow with the square of this, so
  // a swarm of 10,000 plans as fast as one of a thousand; a plan of at
  // most max_pipelines x layers workers never needs more.
  size_t max_planner_candidates = 1000;
};

// What the plan manager works with; none owned, all must outlive it.
struct PlanManagerParts {
  const Planner* planner = nullptr;
  Membership* membership = nullptr;
  NetworkMatrix* network = nullptr;
  ProgressTracker* progress = nullptr;
  ReachabilityManager* reachability = nullptr;
  EventLog* events = nullptr;
  const CheckpointStore* checkpoints = nullptr;
  PlanView* plan_view = nullptr;
  PlanPublisher* publisher = nullptr;
  FaultResponder* faults = nullptr;
  // Submits the state (members, progress, done) for writing; never blocks.
  std::function<void()> persist;
};

class PlanManager {
 public:
  PlanManager(PlanManagerOptions options, PlanManagerParts parts);

  // A recovered coordinator's plan and whether the job had ended.
  void Restore(std::optional<v1::Plan> plan, bool done);

  // Membership changes, after Membership has recorded them.
  void OnJoined(const WorkerRecord& record, const std::string& detail);
  void OnLeft(const std::string& worker_id);
  // A revoked worker: `quarantined` checkpoint files it uploaded were set
  // aside (or the error doing so). With `roll_back_to` (a confirmed wrong
  // computation: the checkpoint store was rolled back to that step), the
  // next plan rolls the whole job back there (Plan.rollback_step): it
  // resumes after that step, every pipeline formed anew and every worker
  // restoring from the checkpoints. Published at once, even where the
  // worker's leaving changes no plan.
  void OnRevoked(const std::string& worker_id, const absl::StatusOr<int>& quarantined,
                 std::optional<int> roll_back_to = std::nullopt);
  // Peer probes changed a member's verdict (ReachabilityManager).
  void OnReachabilityChanged(const ReachabilityManager::Verdict& verdict);
  // The member of a join whose caller gave up is forgotten, unless a plan
  // names it already. Never waits for a search: while one holds the plan's
  // lock the member is forgotten at the next Tick. `forgotten` runs once
  // it is (at once, or on the Tick's thread).
  void ForgetAbandoned(const std::string& worker_id, const std::string& session,
                       std::function<void(const std::string& worker_id)> forgotten);
  // Every worker of the plan reported done: the final plan (job_done).
  void FinishJob();

  // A worker's event the FaultResponder admitted, against the current
  // plan: what the responder decides is done (PERMISSION_DENIED for an
  // accusation of someone not a neighbour).
  absl::Status OnWorkerEvent(const v1::WorkerEvent& event);

  // Re-plans around `expired` (leases Membership ended), plans when enough
  // workers are live, and checks stragglers, voluntary moves and stalls.
  void Tick(const std::vector<WorkerRecord>& expired);

  // For the status: done, the prediction, the suspects among `ids`.
  ControllerFacts Facts(const std::vector<std::string>& ids) const;
  bool done() const;

 private:
  void SetPredictionLocked(v1::PlanPrediction prediction) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnJoinedLocked(const WorkerRecord& record, const std::string& detail)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybePlanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReplanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Carries out the FaultResponder's `action`; true when a plan was
  // published.
  bool ApplyLocked(const FaultResponder::Action& action) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A plan of several pipelines where a worker outside `live` left: a
  // standby takes its place or its pipeline is dissolved (pipeline_repair.h).
  // False when nothing changed.
  bool RepairPipelinesLocked(std::set<std::string> live, const std::string& why = "")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With the outer optimizer: enough standbys (one per stage) form another
  // pipeline at the plan's cuts (up to outer.max_pipelines); the pipelines
  // there are go on (pipeline_continuity.h). Join order only: under the
  // network planner MaybeVoluntaryReplanLocked forms one where the planner
  // would now choose more pipelines. False when none formed.
  bool MaybeFormPipelineLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The network planner's input over `candidates` while a plan runs: the
  // measured links and ports, replica eligibility, and the layer timings
  // calibrated by the stages' measured compute.
  PlannerInput LivePlannerInputLocked(const std::vector<WorkerRecord>& candidates) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pipeline R of the fastest eligible standbys at the plan's cuts (up to
  // outer.max_pipelines), with a replan_considered event saying `why`
  // when given. False when there are too few.
  bool FormPipelineFromStandbysLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // Live workers outside `plan` that may take a stage: those heard from
  // within two heartbeat periods first, each group fastest first. A mass
  // failure silences many at once while their leases run on; without the
  // first key a repair picks a silent standby, then that one's replacement
  // when its lease ends, a new plan each time.
  std::vector<WorkerRecord> StandbysLocked(const v1::Plan& plan) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets PlannerWorkerInfo::may_replicate (FaultResponder::MayReplicate).
  void MarkReplicaCandidatesLocked(PlannerInput* input) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives the stages of `plan` but the last standbys as replicas (middle
  // stages first, then stage 0) until each has job.replicas workers (never
  // a worker demoted as a straggler). True when it added one. Join order
  // only: the network planner chooses replicas.
  bool FillReplicasLocked(v1::Plan* plan, std::string* summary) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes `next` as the following epoch, resuming after the last step.
  void PublishReplanLocked(v1::Plan next, const std::string& summary)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stages over `live` as the planner partitions them; nullopt (and an
  // event) when it cannot.
  std::optional<v1::Plan> PartitionLocked(const std::vector<WorkerRecord>& live,
                                          std::string* summary) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishLocked(v1::Plan plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fills plan->links (AssignLinks over the members' reachability and the
  // usable relays); a link no one can dial is an event.
  void AssignLinksLocked(v1::Plan* plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same stages with links assigned anew (a relay came or went).
  void RelinkLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_ so that events keep the order of the changes they describe.
  void AddEventLocked(const std::string& kind, const std::string& worker,
                      const std::string& detail) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NameOf(const std::string& worker_id) const;
  void Persist() { parts_.persist(); }
  // The epoch of the current plan's link between `reporter` and `peer`.
  uint64_t LinkEpochOfLocked(const std::string& reporter, const std::string& peer) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the current plan's pipelines have drawn of the data.
  PipelineDataInput DataInputLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeVoluntaryReplanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `workers` cut to options_.max_planner_candidates: the plan's members,
  // then those heard from within two heartbeats, then the fastest.
  std::vector<WorkerRecord> BoundedCandidatesLocked(std::vector<WorkerRecord> workers) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct AbandonedJoin {
    std::string worker_id, session;
    std::function<void(const std::string&)> forgotten;
  };
  void ForgetAbandonedLocked(const AbandonedJoin& join) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PlanManagerOptions options_;
  const PlanManagerParts parts_;
  // The parts, by the names the plan code has always used.
  const Planner* const planner_;
  Membership& membership_;
  NetworkMatrix& network_;
  ProgressTracker& progress_;
  ReachabilityManager& reachability_;
  EventLog& events_;
  const CheckpointStore* const checkpoints_;
  PlanPublisher* const publisher_;
  FaultResponder& faults_;  // its lock is taken under mu_, never the other way

  mutable absl::Mutex mu_;
  std::optional<v1::Plan> plan_ ABSL_GUARDED_BY(mu_);
  // What the planner predicted when it last partitioned the layers.
  v1::PlanPrediction prediction_ ABSL_GUARDED_BY(mu_);
  // Its copy for Facts(), which must not wait for mu_ (a search holds it).
  mutable absl::Mutex facts_mu_ ABSL_ACQUIRED_AFTER(mu_);
  v1::PlanPrediction published_prediction_ ABSL_GUARDED_BY(facts_mu_);
  // Written under mu_; read without it (done(), persistence).
  std::atomic<bool> done_{false};
  bool waiting_for_workers_ ABSL_GUARDED_BY(mu_) = false;
  // A rollback the next published plan carries out (OnRevoked).
  std::optional<int> pending_rollback_ ABSL_GUARDED_BY(mu_);
  // The data layouts of the last plans published (their epoch, start
  // step, data_base, pipelines and pipeline_info only), oldest first: where
  // a rollback's steps drew their data (DataIndexAfterStep).
  std::deque<v1::Plan> data_layouts_ ABSL_GUARDED_BY(mu_);
  // When min_workers were first live with no plan yet (-1: not yet): the
  // first plan's pre-flight wait is bounded from there.
  int64_t quorum_since_ms_ ABSL_GUARDED_BY(mu_) = -1;
  // Workers whose figures the first plan's pre-flight found in.
  std::set<std::string> preflight_ready_ ABSL_GUARDED_BY(mu_);
  // Network planner: re-run on fresh figures every 30 s; a better plan is
  // taken when it is worth the move (coordinator/replan_policy.h).
  ReplanPolicy replan_policy_ ABSL_GUARDED_BY(mu_);
  int last_replan_verdict_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t last_replan_event_ms_ ABSL_GUARDED_BY(mu_) = 0;
  // Abandoned joins that found mu_ held, for the next Tick.
  absl::Mutex abandoned_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<AbandonedJoin> abandoned_ ABSL_GUARDED_BY(abandoned_mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PLAN_MANAGER_H_
