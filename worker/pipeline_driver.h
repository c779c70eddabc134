// Runs the pipeline schedule of one stage: decides what to compute next,
// calls StageRuntime, and moves messages between the inbox and the links.
//
// Schedule `sync` (1F1B with a flush): stage 0 keeps at most W = #stages
// microbatches of the current step in flight, feeding a new forward each
// time a gradient returns; every stage applies one optimizer update after
// the step's M backwards, before it reads the next message, so step s+1
// always sees step s's weights. Middle and last stages only react to what
// arrives. Torch-free; runs on one thread.
#ifndef GEOTRAIN_WORKER_PIPELINE_DRIVER_H_
#define GEOTRAIN_WORKER_PIPELINE_DRIVER_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "geotrain/v1/job.pb.h"
#include "worker/link_stream.h"
#include "worker/stage_runtime.h"

namespace geotrain {

// Where a stage reports progress (the coordinator, in production).
class ProgressSink {
 public:
  virtual ~ProgressSink() = default;
  // Called by the last stage after each step (1-based).
  virtual void StepFinished(int step, double loss, int64_t samples) = 0;
  // Called by the last stage after an evaluation pass.
  virtual void EvalFinished(int step, const EvalResult& result) = 0;
  // Called by every stage after its update of `step`.
  virtual void StageProgress(int step) = 0;
};

struct PipelineDriverOptions {
  uint64_t epoch = 0;
  int stage = 0;
  int num_stages = 1;
  int start_step = 0;
};

class PipelineDriver {
 public:
  // `upstream`/`downstream` may be null on the first/last stage. None owned;
  // all must outlive Run().
  PipelineDriver(const v1::JobSpec& job, const PipelineDriverOptions& options,
                 StageRuntime* runtime, MessageSink* upstream,
                 MessageSink* downstream, Inbox* inbox, ProgressSink* progress);

  // Trains until the job's last step (stage 0) or until DONE arrives.
  // Returns an error when a link breaks or computing fails.
  absl::Status Run();

 private:
  absl::Status RunFirstStage();
  absl::Status RunLaterStage();
  absl::Status RunEvaluation(int step);
  absl::StatusOr<InboundMessage> NextMessage();
  absl::Status SendDown(LinkMessage message);
  absl::Status SendUp(LinkMessage message);
  absl::Status FinishStep(int step);

  const v1::JobSpec job_;
  const PipelineDriverOptions options_;
  StageRuntime* runtime_;
  MessageSink* upstream_;
  MessageSink* downstream_;
  Inbox* inbox_;
  ProgressSink* progress_;

  // Last stage: losses of the current step so far.
  double step_loss_sum_ = 0;
  int step_microbatches_ = 0;
  // Middle stages: backwards done in the current step.
  int step_backwards_ = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_PIPELINE_DRIVER_H_
