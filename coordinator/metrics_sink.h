// The job's progress figures: one JSON line per step and per evaluation in
// the metrics log (written off the caller's thread, AppendLog), the same
// figures as TensorBoard scalars (TensorBoardWriter), and the throughput
// over the last steps. Each step line's figures and the event file's points
// for that step are the same: series "train/loss", "train/samples_per_second"
// and "train/learning_rate" at every step, "eval/loss" (and "eval/accuracy"
// for classifiers) at every evaluation. The per-stage and per-link curves
// (RecordStageCurves) go to the event file only. Nothing here waits on the disk, so the
// controller may call it under its lock on every step report.
// Thread-compatible, except Flush, which may run on any thread at any time
// (it touches only the log).
#ifndef GEOTRAIN_COORDINATOR_METRICS_SINK_H_
#define GEOTRAIN_COORDINATOR_METRICS_SINK_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/append_log.h"
#include "coordinator/progress_history.h"
#include "coordinator/tensorboard_writer.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct StepFigures {
  int step = 0;
  double loss = 0;
  int64_t samples = 0;    // trained so far in the job
  double training_s = 0;  // since training started (recovery included)
  double learning_rate = 0;  // of the update that ended the step
  // Resident memory of each live worker, by name.
  std::vector<std::pair<std::string, int64_t>> rss_bytes;
  // With several pipelines: each one's loss of the step, by pipeline.
  std::vector<std::pair<int, double>> pipeline_losses;
};

class MetricsSink {
 public:
  // `log`, `curves`: null for none. `window_steps`: the throughput's window.
  explicit MetricsSink(std::unique_ptr<AppendLog> log, size_t window_steps = 10,
                       std::unique_ptr<TensorBoardWriter> curves = nullptr);

  // `now_s`: any monotonic time in seconds (the throughput's clock).
  void RecordStep(double now_s, const StepFigures& figures);
  void RecordEval(double training_s, const v1::EvalReport& report);
  // Per-stage and per-link figures (StageSeries) as the curves' points at
  // `step`; nothing without curves.
  void RecordStageCurves(int step, const Scalars& series);
  bool has_curves() const { return curves_ != nullptr; }
  // Over the window's steps; 0 until two steps are recorded (or when no
  // time or no sample passed between them).
  double SamplesPerSecond() const;
  double SecondsPerSample() const;
  // The steps and evaluations recorded so far (bounded; the status page).
  const ProgressHistory& history() const { return history_; }
  // Returns once every line and point recorded so far is written (or failed).
  void Flush();

 private:
  const std::unique_ptr<AppendLog> log_;
  const size_t window_steps_;
  const std::unique_ptr<TensorBoardWriter> curves_;
  std::deque<std::pair<double, int64_t>> recent_;  // (now_s, samples)
  ProgressHistory history_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_METRICS_SINK_H_
