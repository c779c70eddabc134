#include "coordinator/loss_jump_watch.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_format.h"

namespace geotrain {

std::string LossJumpWatch::JudgeLocked(int pipeline) const {
  const Figures& mine = pipelines_.at(pipeline);
  std::vector<double> others;
  for (const auto& [r, f] : pipelines_) {
    if (r != pipeline && f.has_newest) others.push_back(f.newest);
  }
  if (others.size() >= 2) {
    std::nth_element(others.begin(), others.begin() + others.size() / 2, others.end());
    const double median = others[others.size() / 2];
    if (median > 0 && mine.newest > options_.others_ratio * median) {
      return absl::StrFormat("pipeline %d's loss %.4g is %.1fx the other pipelines' median %.4g",
                             pipeline, mine.newest, mine.newest / median, median);
    }
  }
  if (mine.history.size() >= options_.min_history) {
    const double largest = *std::max_element(mine.history.begin(), mine.history.end());
    if (largest > 0 && mine.newest > options_.history_ratio * largest) {
      return absl::StrFormat(
          "pipeline %d's loss %.4g jumped to %.1fx the largest of its last %d (%.4g)", pipeline,
          mine.newest, mine.newest / largest, static_cast<int>(mine.history.size()), largest);
    }
  }
  return "";
}

std::optional<std::string> LossJumpWatch::Record(int pipeline, double loss) {
  if (!std::isfinite(loss)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  Figures& mine = pipelines_[pipeline];
  mine.newest = loss;
  mine.has_newest = true;
  const std::string suspicion = JudgeLocked(pipeline);
  if (suspicion.empty()) {
    mine.history.push_back(loss);
    while (mine.history.size() > options_.history_window) mine.history.pop_front();
  }
  if (suspicion.empty() == mine.suspicion.empty()) {
    mine.suspicion = suspicion;  // the newest reason, no change of state
    return std::nullopt;
  }
  mine.suspicion = suspicion;
  return suspicion;
}

std::string LossJumpWatch::SuspicionOf(int pipeline) const {
  absl::MutexLock lock(&mu_);
  auto it = pipelines_.find(pipeline);
  return it == pipelines_.end() ? "" : it->second.suspicion;
}

}  // namespace geotrain
