// Decides which training steps are done, so that no single worker can move
// the job's progress.
//
// The last stage owns the loss and reports each step it finishes (a
// claim); stage 0 finishes a step only after every microbatch of it has
// come back from the last stage, and says so in its heartbeats (the
// corroboration). A step counts (is committed) once both have said so: a
// claim alone waits, however far it reaches, and a stage-0 worker alone
// commits nothing. Where one worker holds both ends (a single-stage
// pipeline) its claims commit at once: nobody else computed anything.
//
// A claim more than `max_lead_steps` past what stage 0 has finished is not
// held but refused as a jump (a worker that says it is far ahead of the
// pipeline it is part of is lying or broken); so is a claim that repeats
// an older step. Claims are dropped at each new plan epoch: the new
// pipeline resumes after the committed step.
//
// Thread-safe: heartbeats call it without the controller's lock.
#ifndef GEOTRAIN_COORDINATOR_PROGRESS_GATE_H_
#define GEOTRAIN_COORDINATOR_PROGRESS_GATE_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace geotrain {

struct ProgressGateOptions {
  int total_steps = 0;
  // How far the last stage's claims may run ahead of stage 0's finished
  // steps: the microbatches in flight plus the steps a heartbeat interval
  // can hold on a fast model, with room.
  int max_lead_steps = 64;
};

class ProgressGate {
 public:
  explicit ProgressGate(ProgressGateOptions options) : options_(options) {}

  // One step's figures, as the last stage reported them.
  struct Step {
    int step = 0;
    double loss = 0;
    int64_t samples = 0;
  };

  // A new plan: its epoch, the workers of its first and last stages, and
  // the committed step it resumes after. Held claims are dropped.
  void StartEpoch(uint64_t epoch, int committed_step, std::set<std::string> first_stage,
                  std::set<std::string> last_stage);

  // A step report from a worker of the last stage (the caller checked that
  // and the report's epoch and figures). Returns the steps committed now,
  // in order (often none: the claim waits for stage 0).
  // FAILED_PRECONDITION: the step is committed or claimed already, or the
  // epoch is not the current one. OUT_OF_RANGE: a jump past what stage 0
  // has finished (see above): the caller raises suspicion.
  absl::StatusOr<std::vector<Step>> Claim(const std::string& worker_id, uint64_t epoch,
                                          const Step& step);

  // A stage-0 worker's heartbeat of `epoch` saying it has finished `step`.
  // Returns the steps committed now. Anything else is ignored.
  std::vector<Step> FirstStageFinished(const std::string& worker_id, uint64_t epoch, int step);

  int committed_step() const;
  // The newest step claimed (held or committed): what a checkpoint may be
  // of at most.
  int claimed_step() const;
  // The newest step stage 0 has finished in this epoch.
  int first_stage_step() const;

 private:
  std::vector<Step> CommitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ProgressGateOptions options_;
  mutable absl::Mutex mu_;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  int committed_ ABSL_GUARDED_BY(mu_) = 0;
  int first_stage_step_ ABSL_GUARDED_BY(mu_) = 0;
  bool single_worker_ ABSL_GUARDED_BY(mu_) = false;
  std::set<std::string> first_stage_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> last_stage_ ABSL_GUARDED_BY(mu_);
  std::map<int, Step> held_ ABSL_GUARDED_BY(mu_);  // claims past committed_
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PROGRESS_GATE_H_
