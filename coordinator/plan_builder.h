// Planning over the cluster's members: the planner's inputs from the job and
// the live workers, and its output as the plan the workers follow. Pure
// functions over snapshots (no lock, no clock).
#ifndef GEOTRAIN_COORDINATOR_PLAN_BUILDER_H_
#define GEOTRAIN_COORDINATOR_PLAN_BUILDER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/membership.h"
#include "coordinator/network_planner.h"
#include "coordinator/replan_policy.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

// "network" or "join-order"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<std::unique_ptr<Planner>> MakePlannerByName(const std::string& name);

// Which codecs a plan may put on its links.
enum class CodecChoice {
  // The job's activation codec on every link (the join-order planner).
  kJobWide,
  // Per link, any codec of the ladder up to the job's (none -> fp16 ->
  // int8 -> int4 or topk; common/adaptive_codec.h): the planner compresses
  // only the links that would otherwise bind, as FusionLLM does.
  kPerLink,
};

// PlannerInput::staleness_cost for async-stash jobs that leave W to the
// planner: each microbatch in flight beyond one per stage costs this much
// loss per sample (plan_builder.cc says what it was measured on).
constexpr double kAsyncStashStalenessCost = 0.35;

// Workers (measured time per layer kind where they reported it, GFLOP/s
// otherwise; memory, reachability; in the order given), the model's layers
// with their activation bytes per cut, the codecs `codecs` allows, the
// job's schedule, shape and window cap. Links: none (the caller adds the
// NetworkMatrix's; pairs it lacks are the default, 1 Gb/s and 1 ms).
PlannerInput PlannerInputFor(const v1::JobSpec& job, const std::vector<WorkerRecord>& workers,
                             CodecChoice codecs = CodecChoice::kJobWide);

// Live calibration: each worker running a stage of `plan` reports its
// compute per microbatch (StageStats); its layer times in `input` (indexed
// like `workers`) are scaled so that its stage's predicted compute equals
// that (co-located workers, other load, throttling: what a pre-flight
// benchmark cannot see). Workers without a stage get the median factor.
// Factors are bounded to [0.1, 10].
void CalibrateWithStageStats(const v1::Plan& plan, const std::vector<WorkerRecord>& workers,
                             PlannerInput* input);

// The plan proto for `plan`, made from `input` over the same `workers`
// (stages, layers, addresses; no links, replicas or epoch yet). The
// network planner's choices travel with it: W (Plan.in_flight) and each
// link's codec (StageAssignment.link_codec, from `input.codecs`).
v1::Plan PlanProtoFor(const PipelinePlan& plan, const PlannerInput& input,
                      const std::vector<WorkerRecord>& workers);

// What a voluntary re-plan weighs: `current` (the plan the workers run)
// re-scored on `input`'s fresh figures, and the cost of moving to `best`:
// the state (weights and AdamW's two moments) of every layer that changes
// worker, moved at the slowest rate among best's links (wire bytes per
// transfer time), and whether those layers' newest checkpoints
// (`checkpointed`: layer -> steps, oldest first) are at most one step
// behind `step`. `workers` are the planner's, indexed like input.workers.
// With pipelines (current.pipelines() = R > 1), both plans are the job's R
// pipelines, scored as the planner scores them (ScorePlan), and a layer a
// stage's worker holds in any pipeline need not move.
// The candidate's measured_s_per_sample is left to the caller. NOT_FOUND
// when a worker of `current` is not among `workers` (a failure, which the
// involuntary path handles); FAILED_PRECONDITION when a stage lacks a
// worker in one of the pipelines (a repair in progress).
struct ReplanComparison {
  PipelinePlan current;
  ReplanCandidate candidate;
};
absl::StatusOr<ReplanComparison> CompareForReplan(
    const v1::JobSpec& job, const PlannerInput& input, const std::vector<WorkerRecord>& workers,
    const v1::Plan& current, const PipelinePlan& best,
    const std::map<int, std::vector<int>>& checkpointed, int step);

// One line per stage for the "planned" event: layers and worker.
std::string SummaryOf(const PipelinePlan& plan, const std::vector<WorkerRecord>& workers);

v1::PlanPrediction PredictionOf(const PlannerInput& input, const PipelinePlan& plan);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PLAN_BUILDER_H_
