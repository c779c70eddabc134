// Where a stage's newcomers take its state: a worker that holds the very
// same stage (index, count and layers) in the previous plan and in the
// next one keeps its weights, so a worker new to that stage can take them
// from it (StageState.FetchLayerState) instead of from the coordinator's
// checkpoints. A replica is preferred over the primary, which is busy
// uploading the stage's checkpoints. Pure; thread-compatible.
#ifndef GEOTRAIN_COORDINATOR_STATE_SOURCES_H_
#define GEOTRAIN_COORDINATOR_STATE_SOURCES_H_

#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

// Sets (or clears) state_source on every stage of `next`. `previous` may be
// null (the first plan: no holder anywhere).
void AssignStateSources(const v1::Plan* previous, v1::Plan* next);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_STATE_SOURCES_H_
