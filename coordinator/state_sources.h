// Where a stage's newcomers take its state: a worker that holds the very
// same stage (index, count and layers) in the previous plan and in the
// next one keeps its weights, so a worker new to that stage can take them
// from it (StageState.FetchLayerState) instead of from the coordinator's
// checkpoints. A replica is preferred over the primary, which is busy
// uploading the stage's checkpoints.
//
// With pipelines (Plan.pipeline_info), a newcomer of a pipeline formed anew
// in `next` gets no holder: it restores the coordinator's checkpoint and
// takes the outer weights from its stage's reducer (the outer sync's
// STATE), as a joining pipeline must. The holder would be a worker of a
// pipeline that goes on training, and a stage's state (4 MB for the
// churn bench's MLP with its optimizer) over that worker's uplink stalled
// its pipeline's activations on 5 Mb/s links; the coordinator's link is
// the one meant for checkpoints. Pure; thread-compatible.
#ifndef GEOTRAIN_COORDINATOR_STATE_SOURCES_H_
#define GEOTRAIN_COORDINATOR_STATE_SOURCES_H_

#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

// Sets (or clears) state_source on every stage of `next`. `previous` may be
// null (the first plan: no holder anywhere). REQUIRES: `next`'s
// pipeline_info, if any, is assigned (AssignPipelineInfo).
void AssignStateSources(const v1::Plan* previous, v1::Plan* next);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_STATE_SOURCES_H_
