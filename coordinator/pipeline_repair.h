// Churn in a plan of several pipelines (Plan.pipelines > 1): a lost worker
// stops only its own pipeline. Its (stage, pipeline) place goes to a
// standby (who takes the stage's state from a live replica in another
// pipeline, see state_sources.h); without one the pipeline is dissolved,
// its live workers become standbys, and the pipelines after it are
// renumbered so that they stay 0..R-1 (the data shards follow R).
// Pipeline 0's worker of each stage is its primary. Pure function.
#ifndef GEOTRAIN_COORDINATOR_PIPELINE_REPAIR_H_
#define GEOTRAIN_COORDINATOR_PIPELINE_REPAIR_H_

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/plan_util.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct PipelineRepair {
  v1::Plan plan;        // the repaired plan (epoch and start step as given)
  bool changed = false;
  bool none_left = false;  // every pipeline lost a stage and none could be refilled
  std::string summary;  // what happened, for the event log
};

// `standbys`: live workers outside the plan, best first; each fills at most
// one place. `name_of` names a worker in the summary.
PipelineRepair RepairPipelines(const v1::Plan& plan, const std::set<std::string>& live,
                               const std::vector<StageWorker>& standbys,
                               const std::function<std::string(const std::string&)>& name_of);

// Rebuilds `stage`'s entries from `workers` (one per pipeline, any order):
// the pipeline-0 worker first (the primary), the others as replicas.
void SetStageWorkers(v1::StageAssignment* stage, std::vector<StageWorker> workers);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PIPELINE_REPAIR_H_
