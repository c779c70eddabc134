// Who works on which stage of a plan: a stage's primary worker and its
// replicas: with pipelines (Plan.pipelines > 1) one worker per pipeline,
// else, with job.replicas > 1, workers routed to within the one pipeline.
#ifndef GEOTRAIN_COMMON_PLAN_UTIL_H_
#define GEOTRAIN_COMMON_PLAN_UTIL_H_

#include <string>
#include <vector>

#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct StageWorker {
  std::string id;
  std::string address;
  int pipeline = 0;
};

// The stage's workers, the primary first.
inline std::vector<StageWorker> WorkersOf(const v1::StageAssignment& stage) {
  std::vector<StageWorker> workers = {{stage.worker_id(), stage.address(), stage.pipeline()}};
  for (const v1::Replica& r : stage.replicas()) {
    workers.push_back({r.worker_id(), r.address(), r.pipeline()});
  }
  return workers;
}

// The stage's workers in pipeline `pipeline`, in the plan's order.
inline std::vector<StageWorker> WorkersOf(const v1::StageAssignment& stage, int pipeline) {
  std::vector<StageWorker> workers;
  for (StageWorker& w : WorkersOf(stage)) {
    if (w.pipeline == pipeline) workers.push_back(std::move(w));
  }
  return workers;
}

// R: the plan's pipelines (at least 1).
// The most microbatches a plan's window (Plan.in_flight) keeps in flight
// when the job sets none (worker/pipeline_driver.h, ConfigureSchedule).
inline constexpr int kMaxPlannedWindow = 32;

inline int PipelinesOf(const v1::Plan& plan) { return plan.pipelines() > 1 ? plan.pipelines() : 1; }

// The stage `worker_id` works on and, in `*index`, its place among the
// stage's workers (0: the primary); nullptr when it has none (a standby).
inline const v1::StageAssignment* StageOf(const v1::Plan& plan, const std::string& worker_id,
                                          int* index = nullptr) {
  for (const v1::StageAssignment& stage : plan.stages()) {
    const std::vector<StageWorker> workers = WorkersOf(stage);
    for (size_t i = 0; i < workers.size(); ++i) {
      if (workers[i].id != worker_id) continue;
      if (index != nullptr) *index = static_cast<int>(i);
      return &stage;
    }
  }
  return nullptr;
}

// Pipeline `pipeline`'s entry in Plan.pipeline_info; null when the plan
// lists none (then every pipeline is formed in the plan's epoch).
inline const v1::PipelineInfo* PipelineInfoOf(const v1::Plan& plan, int pipeline) {
  for (const v1::PipelineInfo& info : plan.pipeline_info()) {
    if (info.pipeline() == pipeline) return &info;
  }
  return nullptr;
}

// The epoch pipeline `pipeline`'s sessions, links and reports carry: the
// one it was formed in.
inline uint64_t SessionEpochOf(const v1::Plan& plan, int pipeline) {
  const v1::PipelineInfo* info = PipelineInfoOf(plan, pipeline);
  return info != nullptr && info->formed_epoch() != 0 ? info->formed_epoch() : plan.epoch();
}

// With OuterOptimizer.split_batch, the microbatches a step of the pipeline
// in data lane `lane` of `stride` runs: the j < M with j * stride + lane <
// M, so the lanes of a step draw its M indices exactly once. REQUIRES:
// 0 <= lane < stride <= M.
inline int SplitMicrobatches(int job_microbatches, int stride, int lane) {
  if (stride <= 1) return job_microbatches;
  return (job_microbatches - lane + stride - 1) / stride;
}

// The epoch `worker_id`'s reports carry: its pipeline's, or the plan's for
// a worker the plan does not name.
inline uint64_t WorkerSessionEpoch(const v1::Plan& plan, const std::string& worker_id) {
  int index = 0;
  const v1::StageAssignment* stage = StageOf(plan, worker_id, &index);
  if (stage == nullptr) return plan.epoch();
  return SessionEpochOf(plan, WorkersOf(*stage)[index].pipeline);
}

// An outer-sync link's epoch: the later of its two pipelines' (a link is
// new whenever either end's pipeline is).
inline uint64_t OuterLinkEpochOf(const v1::Plan& plan, int pipeline_a, int pipeline_b) {
  const uint64_t a = SessionEpochOf(plan, pipeline_a);
  const uint64_t b = SessionEpochOf(plan, pipeline_b);
  return a > b ? a : b;
}

// Every worker the plan gives a stage.
inline int WorkersInPlan(const v1::Plan& plan) {
  int count = 0;
  for (const v1::StageAssignment& stage : plan.stages()) count += 1 + stage.replicas_size();
  return count;
}

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_PLAN_UTIL_H_
