// The job's loss and throughput so far, for the status page's curves: a
// bounded series of steps and one of evaluations. Each keeps every
// stride-th point it is given; when it holds `max_points`, it drops every
// other one and doubles its stride, so the points stay evenly spread over
// the whole run (a long run keeps its whole shape at a coarser grain) and
// memory stays bounded. The newest point is always shown as well.
// Thread-compatible (the controller's lock guards it).
#ifndef GEOTRAIN_COORDINATOR_PROGRESS_HISTORY_H_
#define GEOTRAIN_COORDINATOR_PROGRESS_HISTORY_H_

#include <cstddef>
#include <cstdint>
#include <optional>
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

template <typename Point>
class ThinnedSeries {
 public:
  explicit ThinnedSeries(size_t max_points) : max_points_(max_points < 4 ? 4 : max_points) {}

  void Add(const Point& point) {
    if (given_++ % stride_ == 0) {
      kept_.push_back(point);
      if (kept_.size() >= max_points_) {
        std::vector<Point> thinned;
        thinned.reserve(max_points_ / 2 + 1);
        for (size_t i = 0; i < kept_.size(); i += 2) thinned.push_back(kept_[i]);
        kept_.swap(thinned);
        stride_ *= 2;
      }
    }
    newest_ = point;
  }

  // The kept points, then the newest one if it is not among them.
  std::vector<Point> points() const {
    std::vector<Point> all = kept_;
    if (newest_.has_value() && (given_ - 1) % stride_ != 0) all.push_back(*newest_);
    return all;
  }

 private:
  size_t max_points_;
  uint64_t given_ = 0;
  uint64_t stride_ = 1;
  std::vector<Point> kept_;
  std::optional<Point> newest_;
};

class ProgressHistory {
 public:
  explicit ProgressHistory(size_t max_points = 2000) : steps_(max_points), evals_(max_points) {}

  void AddStep(const StepPoint& point) { steps_.Add(point); }
  void AddEval(const EvalPoint& point) { evals_.Add(point); }
  std::vector<StepPoint> steps() const { return steps_.points(); }
  std::vector<EvalPoint> evals() const { return evals_.points(); }

 private:
  ThinnedSeries<StepPoint> steps_;
  ThinnedSeries<EvalPoint> evals_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PROGRESS_HISTORY_H_
