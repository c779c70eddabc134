// Decides who leaves the plan when something fails, and remembers what
// that makes of a worker:
//   - a worker's fault report (RecordWorkerEvent): its rate, a lost link
//     through a relay (re-link), a lost link between neighbours (the
//     LinkFaultLedger's verdict: which end goes, and whether it is
//     excluded for a while), an accusation of someone not a neighbour
//     (refused);
//   - stragglers (StragglerDetector): a slow stage's worker swapped for a
//     standby, a slow replica demoted;
//   - the progress watchdog: no step for long, it follows whom the
//     workers wait on to the stalled one (or takes stage 0 when nobody is
//     owed anything, or a pipeline that alone stands still).
// It returns Actions; the PlanManager carries them out. And it answers
// the plan side's questions: who is excluded, demoted, or taken out
// recently (no standby, no replica yet).
//
// Its state has a lock of its own. The plan manager calls it with its
// plan lock held (plan, then faults: never the other way). Admit takes
// only this lock: a flood of events never reaches the plan's. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_FAULT_RESPONDER_H_
#define GEOTRAIN_COORDINATOR_FAULT_RESPONDER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/event_log.h"
#include "coordinator/link_fault_ledger.h"
#include "coordinator/membership.h"
#include "coordinator/progress_tracker.h"
#include "coordinator/reachability_manager.h"
#include "coordinator/straggler_detector.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct FaultResponderOptions {
  const Clock* clock = nullptr;  // none owned; all must outlive the responder
  const Membership* membership = nullptr;
  ProgressTracker* progress = nullptr;  // the watchdog's pace
  ReachabilityManager* reachability = nullptr;
  EventLog* events = nullptr;
  int total_steps = 0;
  // Certified callers: an end of many broken links can be excluded.
  bool authenticated_callers = false;
  StragglerOptions stragglers;
  // A worker's events: a bucket of `event_burst` that refills at
  // `events_per_s`; at most `max_buckets` workers tracked.
  double events_per_s = 2;
  double event_burst = 20;
  size_t max_buckets = 1024;
};

class FaultResponder {
 public:
  // What the plan manager is to do.
  struct Action {
    enum class Kind {
      kRelink,           // the same stages, links assigned anew
      kTakeOut,          // `worker_id` leaves the plan (PlanManager::ReplaceLocked)
      kSwapWithStandby,  // a standby takes exactly its place, if there is one
    };
    Kind kind = Kind::kTakeOut;
    std::string worker_id;
    std::string why;
    // Taken out for a broken link: no standby place until it heartbeats
    // again, no replica for a while (MarkTakenOut, once the plan moved).
    bool broken_link = false;
  };

  explicit FaultResponder(FaultResponderOptions options);

  // A worker's event, before any plan lock: INVALID_ARGUMENT for a kind
  // over 64 bytes, PERMISSION_DENIED from an unknown worker,
  // RESOURCE_EXHAUSTED past its rate. An admitted event is in the log.
  absl::Status Admit(const v1::WorkerEvent& event);
  // An admitted event against the current plan: what to do about it.
  // `link_epoch`: the epoch of the plan's link between the event's worker
  // and its peer. PERMISSION_DENIED for an accusation of a worker that is
  // not the accuser's neighbour in `plan`.
  absl::StatusOr<std::optional<Action>> OnWorkerEvent(const v1::WorkerEvent& event,
                                                      const v1::Plan& plan,
                                                      uint64_t link_epoch);
  // Slow stages and replicas of `plan`, in the order to act on (the plan
  // manager stops at the first that changes the plan).
  std::vector<Action> Stragglers(const v1::Plan& plan);
  // The progress watchdog: an action when the job stalled (once per stall
  // period), nullopt while it moves.
  std::optional<Action> CheckProgress(const v1::Plan& plan);

  // A new plan: the stragglers' patience starts over.
  void PlanChanged();
  // `worker_id` left the plan for a broken link (Action::broken_link).
  void MarkTakenOut(const std::string& worker_id);

  // Excluded by the link faults (only with certified callers), with why.
  std::optional<std::string> ExclusionOf(const std::string& worker_id) const;
  // May take a stage as a standby: not excluded, and not taken out for a
  // lost link since its last heartbeat (it may simply be dead).
  bool EligibleStandby(const WorkerRecord& worker) const;
  // May become a replica: not a demoted straggler, and not taken out for a
  // lost link within the last 30 s.
  bool MayReplicate(const std::string& worker_id) const;
  bool Demoted(const std::string& worker_id) const;

 private:
  // The ledger's verdict on a broken (or stalled) link; `how`: "was lost".
  std::optional<Action> BrokenLinkLocked(const std::string& reporter, const std::string& accused,
                                         uint64_t epoch, const char* how)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<Action> StalledPipelineLocked(const v1::Plan& plan,
                                              const ProgressTracker::Pace& pace, int64_t now,
                                              int64_t limit, bool* others_move)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NameOf(const std::string& id) const { return options_.membership->NameOf(id); }

  const FaultResponderOptions options_;
  mutable absl::Mutex mu_;
  struct EventBucket {
    double tokens = 0;
    int64_t at_ms = 0;
  };
  std::map<std::string, EventBucket> event_buckets_ ABSL_GUARDED_BY(mu_);
  // Workers handing their stage over (their links close on purpose).
  std::set<std::string> draining_ ABSL_GUARDED_BY(mu_);
  // Workers taken out of a plan for a lost link, and when.
  std::map<std::string, int64_t> taken_out_ms_ ABSL_GUARDED_BY(mu_);
  // Workers demoted as stragglers: standbys, but never made replicas again.
  std::set<std::string> demoted_ ABSL_GUARDED_BY(mu_);
  LinkFaultLedger link_faults_ ABSL_GUARDED_BY(mu_);
  StragglerDetector stragglers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_FAULT_RESPONDER_H_
