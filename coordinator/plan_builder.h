// Planning over the cluster's members: the planner's inputs from the job and
// the live workers, and its output as the plan the workers follow. Pure
// functions over snapshots (no lock, no clock).
#ifndef GEOTRAIN_COORDINATOR_PLAN_BUILDER_H_
#define GEOTRAIN_COORDINATOR_PLAN_BUILDER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/membership.h"
#include "coordinator/network_planner.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

// "network" or "join-order"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<std::unique_ptr<Planner>> MakePlannerByName(const std::string& name);

// Workers (measured time per layer kind where they reported it, GFLOP/s
// otherwise; memory, reachability; in the order given), the model's layers
// with their activation bytes per cut, the job's schedule, shape and window
// cap. Links: none (the caller adds the NetworkMatrix's; pairs it lacks are
// the default, 1 Gb/s and 1 ms). Codecs: the job's activation codec only
// (the workers apply the job's codec; a plan cannot yet choose per link).
PlannerInput PlannerInputFor(const v1::JobSpec& job, const std::vector<WorkerRecord>& workers);

// Live calibration: each worker running a stage of `plan` reports its
// compute per microbatch (StageStats); its layer times in `input` (indexed
// like `workers`) are scaled so that its stage's predicted compute equals
// that (co-located workers, other load, throttling: what a pre-flight
// benchmark cannot see). Workers without a stage get the median factor.
// Factors are bounded to [0.1, 10].
void CalibrateWithStageStats(const v1::Plan& plan, const std::vector<WorkerRecord>& workers,
                             PlannerInput* input);

// The plan proto for `plan` over the same `workers` (stages, layers,
// addresses; no links, replicas or epoch yet).
v1::Plan PlanProtoFor(const PipelinePlan& plan, const std::vector<WorkerRecord>& workers,
                      int num_layers);

// One line per stage for the "planned" event: layers and worker.
std::string SummaryOf(const PipelinePlan& plan, const std::vector<WorkerRecord>& workers);

v1::PlanPrediction PredictionOf(const PlannerInput& input, const PipelinePlan& plan);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PLAN_BUILDER_H_
