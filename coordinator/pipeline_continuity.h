// Which pipelines of a new plan go on as they were (Plan.pipeline_info):
// with the outer optimizer, a re-plan that leaves a pipeline's chain alone
// (its workers at every stage, the cuts, the links between them and the
// window) does not stop it. Its workers keep their sessions, links and
// progress through the new epoch, and only the pipelines that changed are
// formed anew: at the furthest continuing pipeline's step, on a data lane
// no continuing pipeline uses, past every index drawn before. Pure
// functions.
#ifndef GEOTRAIN_COORDINATOR_PIPELINE_CONTINUITY_H_
#define GEOTRAIN_COORDINATOR_PIPELINE_CONTINUITY_H_

#include <cstdint>
#include <functional>
#include <set>

#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

// The pipelines of `next` that continue from `old`: the same number, an
// entry in old's pipeline_info, and the same chain.
std::set<int> ContinuingPipelines(const v1::Plan& old, const v1::Plan& next);

struct PipelineDataInput {
  int64_t microbatches = 1;  // M, the job's per step
  // OuterOptimizer.split_batch: a pipeline formed anew runs its share of M
  // (SplitMicrobatches) and a step spans M indices, not R x M.
  bool split_batch = false;
  // Steps a stage 0 may have drawn past the last it finished (its window).
  int in_flight_steps = 1;
  // The newest step pipeline r's stage 0 finished under the old plan.
  std::function<int(int pipeline)> first_stage_step;
};

// The index past every one drawn under `old` by the time `next` starts:
// the old plan's high-water mark and what each of its pipelines' stage 0
// may have drawn since (its window included). Without pipeline_info: the
// old plan's shared draw (Plan.data_base, start_step and R).
int64_t DataHighWater(const v1::Plan& old, const PipelineDataInput& input);

// The first data index past those `plan` draws for its steps up to and
// including `step` (at or after its start step): where a job rolled back
// to `step` goes on drawing, so that the steps it trains again see the
// samples they saw the first time and none the rolled-back model has
// seen. With pipelines formed in different plans, past the furthest of
// them (no sample is drawn twice by one model's history; an exact replay
// needs them formed together, as in a job's first plan).
int64_t DataIndexAfterStep(const v1::Plan& plan, int step, int64_t microbatches);

// Sets `next`'s pipeline_info (its data_base already the high-water mark):
// a continuing pipeline keeps its entry, every other is formed in next's
// epoch. `old` is null for a first plan. Returns the continuing pipelines.
// Leaves a plan of one pipeline, that continues nothing, without entries.
std::set<int> AssignPipelineInfo(const v1::Plan* old, const PipelineDataInput& input,
                                 v1::Plan* next);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PIPELINE_CONTINUITY_H_
