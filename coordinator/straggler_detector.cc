#include "coordinator/straggler_detector.h"

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/str_format.h"

namespace geotrain {

double StragglerDetector::BestPaceOf(const std::string& worker_id) const {
  auto it = pace_.find(worker_id);
  return it == pace_.end() ? 0 : it->second.best_s;
}

std::vector<StragglerVerdict> StragglerDetector::Check(const std::vector<StageTimings>& stages,
                                                       int64_t now_ms) {
  // A stage takes as long as its fastest worker (the router avoids the slower).
  std::vector<double> stage_seconds;
  for (const StageTimings& stage : stages) {
    double fastest = 0;
    for (const auto& [id, seconds] : stage.workers) {
      if (seconds <= 0) continue;
      Pace& pace = pace_[id];
      if (pace.best_s == 0 || pace.layer_begin != stage.layer_begin ||
          pace.layer_end != stage.layer_end) {
        pace = {stage.layer_begin, stage.layer_end, seconds};
      }
      pace.best_s = std::min(pace.best_s, seconds);
      fastest = fastest == 0 ? seconds : std::min(fastest, seconds);
    }
    if (fastest == 0) return {};  // not enough figures yet
    stage_seconds.push_back(fastest);
  }
  std::vector<StragglerVerdict> slow;
  for (size_t k = 0; k < stages.size(); ++k) {
    double slowest_other = 0;
    for (size_t j = 0; j < stage_seconds.size(); ++j) {
      if (j != k) slowest_other = std::max(slowest_other, stage_seconds[j]);
    }
    if (slowest_other > 0 && stage_seconds[k] > options_.stage_factor * slowest_other) {
      const auto& worst = *std::max_element(
          stages[k].workers.begin(), stages[k].workers.end(),
          [](const auto& a, const auto& b) { return a.second < b.second; });
      const double best = pace_[worst.first].best_s;
      if (worst.second > options_.slowdown_factor * best) {
        slow.push_back({worst.first,
                        absl::StrFormat("stage %d takes %.1f ms per microbatch, %.1fx the "
                                        "slowest other stage and %.1fx its own best",
                                        k, stage_seconds[k] * 1e3,
                                        stage_seconds[k] / slowest_other, worst.second / best),
                        false});
      }
      continue;
    }
    if (stages[k].workers.size() < 2) continue;
    for (const auto& [id, seconds] : stages[k].workers) {
      if (seconds > options_.stage_factor * stage_seconds[k]) {
        slow.push_back({id,
                        absl::StrFormat("a worker of stage %d takes %.1f ms per microbatch, "
                                        "%.1fx its fastest replica",
                                        k, seconds * 1e3, seconds / stage_seconds[k]),
                        true});
      }
    }
  }
  std::set<std::string> slow_ids;
  for (const StragglerVerdict& v : slow) slow_ids.insert(v.worker_id);
  for (auto it = straggling_since_ms_.begin(); it != straggling_since_ms_.end();) {
    it = slow_ids.count(it->first) > 0 ? std::next(it) : straggling_since_ms_.erase(it);
  }
  std::vector<StragglerVerdict> due;
  for (StragglerVerdict& v : slow) {
    const int64_t since = straggling_since_ms_.emplace(v.worker_id, now_ms).first->second;
    if (now_ms - since < options_.patience_ms) continue;
    v.reason = absl::StrFormat("%s, for %.0f s", v.reason, (now_ms - since) / 1000.0);
    straggling_since_ms_[v.worker_id] = now_ms;  // again only after another patience period
    due.push_back(std::move(v));
  }
  return due;
}

}  // namespace geotrain
