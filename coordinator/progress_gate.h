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
// With R pipelines (Plan.pipelines) each has its own last stage and stage
// 0, and each pipeline's claims are corroborated by its own stage 0. A
// step of the job is a global batch: it commits once every pipeline has
// finished it, with the samples of all of them and their samples-weighted
// mean loss.
//
// A claim more than `max_lead_steps` past what stage 0 has finished is not
// held but refused as a jump (a worker that says it is far ahead of the
// pipeline it is part of is lying or broken); so is a claim that repeats
// an older step. At each new plan epoch a pipeline formed anew drops its
// claims and resumes after the committed step, or after its own start
// step (Plan.pipeline_info: the steps before it count as done for it, with
// no samples); a pipeline that continues from the plan before keeps its
// claims and progress, and its workers report with the epoch it was
// formed in.
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
    // With several pipelines: each one's loss of the step, by pipeline.
    std::vector<std::pair<int, double>> pipeline_losses;
  };

  // A pipeline of a new plan: the epoch it was formed in (its reports
  // carry it) and the step it starts after.
  struct PipelineStart {
    uint64_t formed_epoch = 0;
    int start_step = 0;
  };
  // A new plan: its epoch, the workers of its first and last stages (each
  // with its pipeline, 0 to R-1), and the committed step it resumes after.
  // `starts`, by pipeline (missing: formed in `epoch`, at the committed
  // step): a pipeline formed in an earlier epoch that this gate tracks
  // under the same number continues; every other drops its held claims.
  void StartEpoch(uint64_t epoch, int committed_step, std::map<std::string, int> first_stage,
                  std::map<std::string, int> last_stage,
                  std::map<int, PipelineStart> starts = {});

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

  // The job rolled back (Plan.rollback_step): the committed step goes back
  // to `step`, the only way it ever goes down, and every claim held is
  // dropped. Call before the rolling-back plan's StartEpoch, which forms
  // every pipeline anew.
  void RollBack(int step);

  int committed_step() const;
  // The newest step claimed (held or committed): what a checkpoint may be
  // of at most.
  int claimed_step() const;
  // The newest step stage 0 has finished in this epoch: of the pipeline
  // that is furthest behind, or of pipeline `pipeline`.
  int first_stage_step() const;
  int first_stage_step(int pipeline) const;
  // The pipeline furthest behind (the one holding the job's step back).
  int slowest_pipeline() const;

 private:
  struct Pipeline {
    uint64_t formed_epoch = 0;  // its workers' reports carry it
    int first_stage_step = 0;
    bool single_worker = false;  // one worker holds both ends
    std::map<int, Step> held;    // claims stage 0 has not corroborated yet
    std::map<int, Step> ready;   // corroborated, waiting for the others
    int ready_step = 0;          // newest corroborated step
  };
  std::vector<Step> CommitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int SlowestLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ProgressGateOptions options_;
  mutable absl::Mutex mu_;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  int committed_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int> first_stage_ ABSL_GUARDED_BY(mu_);  // worker -> pipeline
  std::map<std::string, int> last_stage_ ABSL_GUARDED_BY(mu_);
  std::vector<Pipeline> pipelines_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PROGRESS_GATE_H_
