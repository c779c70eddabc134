// A plan of R pipelines of `stages` stages for the coordinator's unit
// tests: worker "p<r>s<k>" serves stage k of pipeline r (pipeline 0's are
// the stages' primaries, the others' replicas), linked in a chain per
// pipeline. Epoch 4.
#ifndef GEOTRAIN_TESTS_COORDINATOR_PIPELINES_PLAN_H_
#define GEOTRAIN_TESTS_COORDINATOR_PIPELINES_PLAN_H_

#include <string>

#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

inline std::string PipelineWorker(int pipeline, int stage) {
  return "p" + std::to_string(pipeline) + "s" + std::to_string(stage);
}

inline v1::Plan PipelinesPlan(int pipelines, int stages = 3) {
  v1::Plan plan;
  plan.set_epoch(4);
  plan.set_pipelines(pipelines);
  for (int k = 0; k < stages; ++k) {
    v1::StageAssignment* stage = plan.add_stages();
    stage->set_stage(k);
    stage->set_worker_id(PipelineWorker(0, k));
    for (int r = 1; r < pipelines; ++r) {
      v1::Replica* replica = stage->add_replicas();
      replica->set_worker_id(PipelineWorker(r, k));
      replica->set_pipeline(r);
    }
  }
  for (int r = 0; r < pipelines; ++r) {
    for (int k = 0; k + 1 < stages; ++k) {
      v1::PlannedLink* link = plan.add_links();
      link->set_upstream_worker(PipelineWorker(r, k));
      link->set_downstream_worker(PipelineWorker(r, k + 1));
    }
  }
  return plan;
}

}  // namespace geotrain

#endif  // GEOTRAIN_TESTS_COORDINATOR_PIPELINES_PLAN_H_
