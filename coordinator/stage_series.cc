#include "coordinator/stage_series.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"

namespace geotrain {

Scalars StageSeries(const v1::Plan& plan, const std::vector<WorkerRecord>& workers) {
  std::map<std::string, const WorkerRecord*> by_id;
  std::map<std::string, std::string> name_by_address;
  for (const WorkerRecord& w : workers) {
    by_id[w.id] = &w;
    name_by_address[w.address] = w.name;
  }
  Scalars series;
  for (const v1::StageAssignment& stage : plan.stages()) {
    const auto primary = by_id.find(stage.worker_id());
    if (primary == by_id.end() || !primary->second->alive) continue;
    const v1::StageStats& stats = primary->second->stats;
    if (stats.compute_s_per_microbatch() <= 0) continue;  // no figures yet
    const std::string prefix = absl::StrCat("stage", stage.stage());
    series.emplace_back(prefix + "/compute_seconds_per_microbatch",
                        stats.compute_s_per_microbatch());
    series.emplace_back(prefix + "/bubble_fraction", stats.bubble_fraction());
    series.emplace_back(prefix + "/staleness_mean", stats.staleness_mean());
    for (const v1::LinkStats& link : stats.links()) {
      const auto peer = name_by_address.find(link.peer());
      const std::string name = absl::StrCat(
          "link/", prefix, ".", link.direction(), ".",
          peer == name_by_address.end() ? link.peer() : peer->second);
      series.emplace_back(name + "/goodput_bits_per_second", link.goodput_bps());
      series.emplace_back(name + "/compression_ratio", link.compression_ratio());
    }
  }
  return series;
}

}  // namespace geotrain
