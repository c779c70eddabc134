// The job's progress: step, evaluation and done reports, the committed
// figures (step, loss, samples, validation), the metrics log and the
// TensorBoard curves, each pipeline's newest claim, and the pace the
// progress watchdog reads.
//
// It owns its state and lock and reads the plan from a PlanView: no report
// waits for a plan decision, and heartbeats that corroborate steps take
// only this lock. Which steps count is the ProgressGate's (it owns one);
// the plan side tells it when a plan starts (StartEpoch). Committed steps
// call `persist` with no lock of this class held. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_PROGRESS_TRACKER_H_
#define GEOTRAIN_COORDINATOR_PROGRESS_TRACKER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/event_log.h"
#include "coordinator/membership.h"
#include "coordinator/metrics_sink.h"
#include "coordinator/plan_view.h"
#include "coordinator/progress_gate.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct ProgressTrackerOptions {
  const v1::JobSpec* job = nullptr;  // none owned; all must outlive the tracker
  const Clock* clock = nullptr;
  int64_t start_ms = 0;  // the coordinator's start (ElapsedS counts from it)
  const Membership* membership = nullptr;
  const PlanView* plan = nullptr;
  EventLog* events = nullptr;
  // After each commit, with no lock of the tracker held (a restarted
  // coordinator must not resume from a step the workers have done).
  std::function<void()> persist;
  // How far the last stage's claims may lead stage 0 (ProgressGate), and
  // how far from the end a premature done report is a lie, not a race.
  int lead_steps = 64;
  // Bounds the suspects remembered (one event each).
  size_t max_suspects = 256;
  // With several pipelines: each one's loss of each step it reports, under
  // the tracker's lock (LossJumpWatch). May be empty.
  std::function<void(int pipeline, double loss)> on_pipeline_loss;
};

class ProgressTracker {
 public:
  explicit ProgressTracker(ProgressTrackerOptions options);

  // A recovered coordinator's figures; `has_plan`: training had begun.
  void Restore(const v1::CoordinatorState& saved, bool has_plan);
  // The metrics log (and curves) once recovery has said whether it
  // continues; until then figures go nowhere.
  void SetMetrics(std::unique_ptr<MetricsSink> metrics);
  // The figures a state write keeps.
  void FillState(v1::CoordinatorState* state) const;

  // A plan begins (the first): training time counts from now.
  void StartTraining();
  // A new plan is being made: until StartEpoch no step commits (reports
  // are refused with UNAVAILABLE, for the worker to send again;
  // corroborations are ignored), so the committed step returned is the one
  // the new plan resumes after.
  int CloseEpoch();
  // A new plan: the gate learns its first and last stages; a continuing
  // pipeline keeps its last claim; the watchdog's clock restarts; steps
  // commit again.
  void StartEpoch(const v1::Plan& plan);
  // A plan that rolls the job back to `step` is being published (before
  // its StartEpoch): the committed step goes back there (ProgressGate).
  void RollBack(int step);

  // Refuses reports of another epoch or of a step that is not new
  // (FAILED_PRECONDITION), of workers the plan does not put on the last
  // stage (PERMISSION_DENIED; ReportDone: on any stage), and of figures out
  // of range: a step past the job's, a loss that is not finite
  // (INVALID_ARGUMENT). A stage-0 worker's step report corroborates.
  absl::Status ReportStep(const v1::StepReport& report);
  absl::Status ReportEval(const v1::EvalReport& report);
  // True when this report made every worker of the plan done (once).
  absl::StatusOr<bool> ReportDone(const v1::DoneReport& report);
  // A stage-0 worker's heartbeat saying it has finished `step` of `epoch`.
  void FirstStageFinished(const std::string& worker_id, uint64_t epoch, int step);

  // TensorBoard's per-stage and per-link curves get one point per step:
  // step s's are the figures of the first heartbeats that came after every
  // stage's primary had finished s (its heartbeat's step >= s), so each
  // point is a measurement that covers its step; once the job is done
  // (`job_done`), or after 10 s without the figures of every stage, the
  // last figures cover the steps still open. Nothing without curves.
  void WriteStageCurves(bool job_done);

  struct Figures {
    int step = 0;
    double loss = 0;
    int64_t samples = 0;
    double val_loss = 0;
    double accuracy = 0;
    double samples_per_s = 0;
    double seconds_per_sample = 0;
    // Each pipeline's newest claimed step and loss (this epoch).
    std::map<int, std::pair<int, double>> pipeline_claims;
    std::set<std::string> done_workers;
  };
  Figures Snapshot() const;

  // What the progress watchdog reads.
  struct Pace {
    int step = 0;
    bool any_done = false;
    int64_t last_progress_ms = 0;  // a commit, or the watchdog's last act
    int64_t epoch_started_ms = 0;
    bool progress_in_epoch = false;
    int64_t step_interval_ms = 0;  // recent time per step
    std::map<int, int64_t> pipeline_moved_ms;  // when each last claimed
  };
  Pace pace() const;
  // The watchdog acted on a stall: one action per stall period.
  void MarkStallHandled(int64_t now_ms);

  bool IsDone(const std::string& worker_id) const;
  bool AnyDone() const;
  std::set<std::string> DoneWorkers() const;
  int committed_step() const;
  const ProgressGate& gate() const { return gate_; }
  // Where stage 0 of `pipeline` has got to, at least the committed step.
  int FirstStageStep(int pipeline) const;
  ProgressHistory History() const;
  // Waits until the metrics lines recorded so far are written.
  void Flush();

 private:
  double ElapsedS() const;
  // Records committed steps (metrics log, curves' clock); returns whether
  // any was committed, so that the caller persists after unlocking.
  bool CommitLocked(const std::vector<ProgressGate::Step>& steps)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PersistIf(bool committed);

  const ProgressTrackerOptions options_;
  ProgressGate gate_;  // thread-safe itself
  mutable absl::Mutex mu_;
  std::unique_ptr<MetricsSink> metrics_ ABSL_GUARDED_BY(mu_);
  int step_ ABSL_GUARDED_BY(mu_) = 0;
  double loss_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t samples_ ABSL_GUARDED_BY(mu_) = 0;
  double training_start_s_ ABSL_GUARDED_BY(mu_) = -1;
  double val_loss_ ABSL_GUARDED_BY(mu_) = 0;
  double accuracy_ ABSL_GUARDED_BY(mu_) = 0;
  int curves_step_ ABSL_GUARDED_BY(mu_) = 0;  // the last step with stage curves
  double curves_waiting_since_s_ ABSL_GUARDED_BY(mu_) = -1;  // for the figures of step+1
  std::map<int, std::pair<int, double>> pipeline_claims_ ABSL_GUARDED_BY(mu_);
  std::map<int, int64_t> pipeline_moved_ms_ ABSL_GUARDED_BY(mu_);
  // (worker, epoch) already suspected for a jump in its step reports, and
  // workers already suspected for a premature done (one event each).
  std::set<std::pair<std::string, uint64_t>> suspected_claims_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> done_refused_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> done_workers_ ABSL_GUARDED_BY(mu_);
  bool all_done_ ABSL_GUARDED_BY(mu_) = false;
  int64_t last_progress_ms_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t epoch_started_ms_ ABSL_GUARDED_BY(mu_) = 0;
  bool progress_in_epoch_ ABSL_GUARDED_BY(mu_) = false;
  int64_t step_interval_ms_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // CloseEpoch until StartEpoch
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PROGRESS_TRACKER_H_
