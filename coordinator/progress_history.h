// The job's loss and throughput so far, for the status page's curves: a
// bounded series of steps and one of evaluations. When a series reaches
// `max_points`, every other point of it is dropped (the first and the
// newest stay), so a long run keeps its whole shape at a coarser grain and
// memory stays bounded. Thread-compatible (the controller's lock guards it).
#ifndef GEOTRAIN_COORDINATOR_PROGRESS_HISTORY_H_
#define GEOTRAIN_COORDINATOR_PROGRESS_HISTORY_H_

#include <cstddef>
#include <vector>

namespace geotrain {

struct StepPoint {
  int step = 0;
  double loss = 0;
  double samples_per_s = 0;
  double time_s = 0;  // training time
};

struct EvalPoint {
  int step = 0;
  double val_loss = 0;
  double accuracy = 0;
  bool has_accuracy = false;
  double time_s = 0;
};

class ProgressHistory {
 public:
  explicit ProgressHistory(size_t max_points = 2000) : max_points_(max_points < 4 ? 4 : max_points) {}

  void AddStep(const StepPoint& point) { Add(&steps_, point); }
  void AddEval(const EvalPoint& point) { Add(&evals_, point); }
  const std::vector<StepPoint>& steps() const { return steps_; }
  const std::vector<EvalPoint>& evals() const { return evals_; }

 private:
  template <typename Point>
  void Add(std::vector<Point>* series, const Point& point) {
    series->push_back(point);
    if (series->size() <= max_points_) return;
    std::vector<Point> kept;
    kept.reserve(max_points_ / 2 + 2);
    for (size_t i = 0; i + 1 < series->size(); i += 2) kept.push_back((*series)[i]);
    kept.push_back(series->back());
    series->swap(kept);
  }

  size_t max_points_;
  std::vector<StepPoint> steps_;
  std::vector<EvalPoint> evals_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PROGRESS_HISTORY_H_
