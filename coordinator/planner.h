// Planner v1: cuts the model's layers into contiguous stages and gives each
// stage to one worker, balancing estimated stage time (FLOPs / measured
// FLOP/s) within each worker's memory. Pure function; thread-compatible.
#ifndef GEOTRAIN_COORDINATOR_PLANNER_H_
#define GEOTRAIN_COORDINATOR_PLANNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_profile.h"

namespace geotrain {

struct PlannerWorker {
  std::string id;
  double gflops = 0;          // measured matmul throughput
  uint64_t memory_bytes = 0;  // usable memory
};

struct StageRange {
  int layer_begin = 0;  // inclusive
  int layer_end = 0;    // exclusive
  std::string worker_id;
  double estimated_s = 0;  // seconds per sample, from the profile
};

// Uses min(#workers, #layers, max_stages if > 0) stages. When there are more
// workers than stages the fastest are used; the chosen ones keep their order
// in `workers` (join order), so stage order is stable. Returns
// RESOURCE_EXHAUSTED when no partition fits the workers' memory.
absl::StatusOr<std::vector<StageRange>> PlanStages(
    const std::vector<LayerProfile>& layers,
    const std::vector<PlannerWorker>& workers, int max_stages);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PLANNER_H_
