#include "coordinator/pipeline_continuity.h"

#include <algorithm>
#include <vector>

#include "common/plan_util.h"

namespace geotrain {
namespace {

std::vector<std::string> IdsOf(const v1::StageAssignment& stage, int pipeline) {
  std::vector<std::string> ids;
  for (const StageWorker& w : WorkersOf(stage, pipeline)) ids.push_back(w.id);
  return ids;
}

// The plan's link from `up` to `down` (not an outer one), or null.
const v1::PlannedLink* PipelineLink(const v1::Plan& plan, const std::string& up,
                                    const std::string& down) {
  for (const v1::PlannedLink& link : plan.links()) {
    if (!link.outer() && link.upstream_worker() == up && link.downstream_worker() == down) {
      return &link;
    }
  }
  return nullptr;
}

bool SameLink(const v1::PlannedLink* a, const v1::PlannedLink* b) {
  if (a == nullptr || b == nullptr) return a == b;
  return a->dialer() == b->dialer() && a->relay_worker() == b->relay_worker() &&
         a->relay_address() == b->relay_address();
}

bool SameChain(const v1::Plan& old, const v1::Plan& next, int pipeline) {
  if (old.stages_size() != next.stages_size() || old.in_flight() != next.in_flight()) {
    return false;
  }
  std::vector<std::string> previous;
  for (int k = 0; k < old.stages_size(); ++k) {
    const v1::StageAssignment& a = old.stages(k);
    const v1::StageAssignment& b = next.stages(k);
    if (a.layer_begin() != b.layer_begin() || a.layer_end() != b.layer_end() ||
        a.link_codec() != b.link_codec()) {
      return false;
    }
    const std::vector<std::string> ids = IdsOf(b, pipeline);
    if (ids.empty() || ids != IdsOf(a, pipeline)) return false;
    for (const std::string& up : previous) {
      for (const std::string& down : ids) {
        if (!SameLink(PipelineLink(old, up, down), PipelineLink(next, up, down))) return false;
      }
    }
    previous = ids;
  }
  return true;
}

int64_t RoundUp(int64_t value, int64_t multiple) {
  return multiple <= 1 ? value : (value + multiple - 1) / multiple * multiple;
}

}  // namespace

std::set<int> ContinuingPipelines(const v1::Plan& old, const v1::Plan& next) {
  std::set<int> continuing;
  for (int r = 0; r < std::min(PipelinesOf(old), PipelinesOf(next)); ++r) {
    if (PipelineInfoOf(old, r) != nullptr && SameChain(old, next, r)) continuing.insert(r);
  }
  return continuing;
}

int64_t DataHighWater(const v1::Plan& old, const PipelineDataInput& input) {
  const int64_t m = std::max<int64_t>(1, input.microbatches);
  auto drawn_step = [&input](int pipeline, int start) {
    return std::max(start, input.first_stage_step(pipeline)) + 1 + input.in_flight_steps;
  };
  if (old.pipeline_info_size() > 0) {
    int64_t high = static_cast<int64_t>(old.data_base());
    for (const v1::PipelineInfo& info : old.pipeline_info()) {
      const int64_t steps = drawn_step(info.pipeline(), info.start_step()) - info.start_step();
      const int64_t block = info.data_block() > 0
                                ? info.data_block()
                                : std::max(1, info.data_stride()) * m;
      high = std::max(high, static_cast<int64_t>(info.data_base()) + steps * block);
    }
    return high;
  }
  const int pipelines = PipelinesOf(old);
  const int64_t base = old.has_data_base()
                           ? static_cast<int64_t>(old.data_base())
                           : int64_t{old.start_step()} * pipelines * m;
  int drawn_to = old.start_step();
  for (int r = 0; r < pipelines; ++r) drawn_to = std::max(drawn_to, drawn_step(r, old.start_step()));
  return base + int64_t{drawn_to - old.start_step()} * pipelines * m;
}

int64_t DataIndexAfterStep(const v1::Plan& plan, int step, int64_t microbatches) {
  const int64_t m = std::max<int64_t>(1, microbatches);
  if (plan.pipeline_info_size() > 0) {
    int64_t index = 0;
    for (const v1::PipelineInfo& info : plan.pipeline_info()) {
      const int64_t block = info.data_block() > 0 ? info.data_block()
                                                  : std::max(1, info.data_stride()) * m;
      index = std::max(index, static_cast<int64_t>(info.data_base()) +
                                  std::max(0, step - info.start_step()) * block);
    }
    return index;
  }
  const int pipelines = PipelinesOf(plan);
  const int64_t base = plan.has_data_base() ? static_cast<int64_t>(plan.data_base())
                                            : int64_t{plan.start_step()} * pipelines * m;
  return base + int64_t{std::max(0, step - plan.start_step())} * pipelines * m;
}

std::set<int> AssignPipelineInfo(const v1::Plan* old, const PipelineDataInput& input,
                                 v1::Plan* next) {
  next->clear_pipeline_info();
  const int pipelines = PipelinesOf(*next);
  std::set<int> continuing;
  if (old != nullptr) continuing = ContinuingPipelines(*old, *next);
  if (pipelines <= 1 && continuing.empty()) return continuing;
  int stride = pipelines;
  std::set<int> free_lanes;
  if (!continuing.empty()) {
    stride = std::max(1, PipelineInfoOf(*old, *continuing.begin())->data_stride());
    for (int lane = 0; lane < stride; ++lane) free_lanes.insert(lane);
    for (int r : continuing) free_lanes.erase(PipelineInfoOf(*old, r)->data_lane());
    // More new pipelines than free lanes: every pipeline starts anew.
    if (pipelines - static_cast<int>(continuing.size()) > static_cast<int>(free_lanes.size())) {
      continuing.clear();
      stride = pipelines;
    }
  }
  if (continuing.empty()) {
    free_lanes.clear();
    for (int lane = 0; lane < stride; ++lane) free_lanes.insert(lane);
  }
  const int64_t m = std::max<int64_t>(1, input.microbatches);
  // Split, a step's M indices are shared among the lanes; a continuing
  // pipeline keeps the split it was formed with (its stride is this one).
  const bool split = input.split_batch && stride <= m;
  const int64_t block = split ? m : stride * m;
  const uint64_t base =
      static_cast<uint64_t>(RoundUp(static_cast<int64_t>(next->data_base()), block));
  // A pipeline formed anew starts where the furthest continuing one is, so
  // that their outer rounds end together.
  int start = next->start_step();
  for (int r : continuing) start = std::max(start, input.first_stage_step(r));
  for (int r = 0; r < pipelines; ++r) {
    v1::PipelineInfo* info = next->add_pipeline_info();
    if (continuing.count(r) > 0) {
      *info = *PipelineInfoOf(*old, r);
      continue;
    }
    info->set_pipeline(r);
    info->set_formed_epoch(next->epoch());
    info->set_start_step(start);
    info->set_data_base(base);
    info->set_data_stride(stride);
    info->set_data_lane(*free_lanes.begin());
    free_lanes.erase(free_lanes.begin());
    if (split) {
      info->set_microbatches(
          SplitMicrobatches(static_cast<int>(m), stride, info->data_lane()));
      info->set_data_block(block);
    }
  }
  return continuing;
}

}  // namespace geotrain
