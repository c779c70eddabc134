// The job's progress figures: one JSON line per step and per evaluation in
// the metrics log (written off the caller's thread, AppendLog), and the
// throughput over the last steps. Nothing here waits on the disk, so the
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
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct StepFigures {
  int step = 0;
  double loss = 0;
  int64_t samples = 0;    // trained so far in the job
  double training_s = 0;  // since training started (recovery included)
  // Resident memory of each live worker, by name.
  std::vector<std::pair<std::string, int64_t>> rss_bytes;
};

class MetricsSink {
 public:
  // `log`: null for none. `window_steps`: the throughput's window.
  explicit MetricsSink(std::unique_ptr<AppendLog> log, size_t window_steps = 10);

  // `now_s`: any monotonic time in seconds (the throughput's clock).
  void RecordStep(double now_s, const StepFigures& figures);
  void RecordEval(double training_s, const v1::EvalReport& report);
  // Over the window's steps; 0 until two steps are recorded (or when no
  // time or no sample passed between them).
  double SamplesPerSecond() const;
  double SecondsPerSample() const;
  // Returns once every line recorded so far is written (or failed).
  void Flush();

 private:
  const std::unique_ptr<AppendLog> log_;
  const size_t window_steps_;
  std::deque<std::pair<double, int64_t>> recent_;  // (now_s, samples)
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_METRICS_SINK_H_
