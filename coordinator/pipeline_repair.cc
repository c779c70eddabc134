#include "coordinator/pipeline_repair.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"

namespace geotrain {

void SetStageWorkers(v1::StageAssignment* stage, std::vector<StageWorker> workers) {
  std::stable_sort(workers.begin(), workers.end(),
                   [](const StageWorker& a, const StageWorker& b) { return a.pipeline < b.pipeline; });
  stage->clear_replicas();
  if (workers.empty()) return;
  stage->set_worker_id(workers[0].id);
  stage->set_address(workers[0].address);
  stage->set_pipeline(workers[0].pipeline);
  for (size_t i = 1; i < workers.size(); ++i) {
    v1::Replica* replica = stage->add_replicas();
    replica->set_worker_id(workers[i].id);
    replica->set_address(workers[i].address);
    replica->set_pipeline(workers[i].pipeline);
  }
}

PipelineRepair RepairPipelines(const v1::Plan& plan, const std::set<std::string>& live,
                               const std::vector<StageWorker>& standbys,
                               const std::function<std::string(const std::string&)>& name_of) {
  PipelineRepair out;
  out.plan = plan;
  auto note = [&out](const std::string& what) {
    absl::StrAppend(&out.summary, out.summary.empty() ? "" : ", ", what);
  };
  const int pipelines = PipelinesOf(plan);
  size_t next_standby = 0;
  std::set<int> dissolved;
  // Each lost place: a standby, or the pipeline goes.
  std::vector<std::vector<StageWorker>> stages;
  for (const v1::StageAssignment& stage : plan.stages()) {
    std::vector<StageWorker> workers = WorkersOf(stage);
    for (StageWorker& w : workers) {
      if (live.count(w.id) > 0) continue;
      out.changed = true;
      if (next_standby < standbys.size()) {
        const StageWorker& standby = standbys[next_standby++];
        note(absl::StrCat("pipeline ", w.pipeline, " stage ", stage.stage(), ": ", name_of(w.id),
                          " lost -> ", name_of(standby.id), " (standby)"));
        w.id = standby.id;
        w.address = standby.address;
      } else if (dissolved.insert(w.pipeline).second) {
        note(absl::StrCat("pipeline ", w.pipeline, " stage ", stage.stage(), ": ", name_of(w.id),
                          " lost and no standby: pipeline ", w.pipeline,
                          " dissolved, its workers stand by"));
      }
    }
    stages.push_back(std::move(workers));
  }
  if (!out.changed) return out;
  // Renumber what is left: 0..R'-1 in the old order.
  std::map<int, int> renumbered;
  for (int p = 0; p < pipelines; ++p) {
    if (dissolved.count(p) == 0) renumbered[p] = static_cast<int>(renumbered.size());
  }
  if (renumbered.empty()) {
    out.none_left = true;
    return out;
  }
  for (size_t k = 0; k < stages.size(); ++k) {
    std::vector<StageWorker> kept;
    for (StageWorker w : stages[k]) {
      auto to = renumbered.find(w.pipeline);
      if (to == renumbered.end()) continue;
      w.pipeline = to->second;
      kept.push_back(w);
    }
    SetStageWorkers(out.plan.mutable_stages(static_cast<int>(k)), std::move(kept));
  }
  const int left = static_cast<int>(renumbered.size());
  if (left > 1) {
    out.plan.set_pipelines(left);
  } else {
    out.plan.clear_pipelines();
  }
  if (!dissolved.empty()) note(absl::StrCat(left, " pipeline", left == 1 ? "" : "s", " left"));
  return out;
}

}  // namespace geotrain
