#include "worker/served_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/adaptive_codec.h"

namespace geotrain {

absl::StatusOr<ServedPlan> ServedPlan::For(const v1::Plan& plan, const v1::JobSpec& job,
                                           const std::string& worker_id) {
  int index = 0;
  const v1::StageAssignment* mine = StageOf(plan, worker_id, &index);
  if (mine == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("the plan of epoch ", plan.epoch(), " has no stage for '", worker_id, "'"));
  }
  ServedPlan served;
  served.plan_ = plan;
  served.self_id_ = worker_id;
  served.stage_ = mine->stage();
  served.primary_ = index == 0;
  served.pipeline_ = WorkersOf(*mine)[index].pipeline;
  if (served.pipeline_ < 0 || served.pipeline_ >= PipelinesOf(plan)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the plan of epoch ", plan.epoch(), " puts '", worker_id, "' in pipeline ",
        served.pipeline_, " of ", PipelinesOf(plan)));
  }
  if (served.stage_ < 0 || served.stage_ >= plan.stages_size() ||
      plan.stages(served.stage_).stage() != served.stage_) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan of epoch ", plan.epoch(), " lists stage ", served.stage_,
                     " out of order"));
  }
  const int stage = served.stage_;
  const int pipeline = served.pipeline_;
  if (stage > 0) served.upstream_ = WorkersOf(plan.stages(stage - 1), pipeline);
  if (stage + 1 < plan.stages_size()) {
    served.downstream_ = WorkersOf(plan.stages(stage + 1), pipeline);
  }
  served.stage_workers_ = WorkersOf(*mine, pipeline);
  for (const StageWorker& w : WorkersOf(*mine)) {
    if (w.pipeline != pipeline) served.outer_peers_.push_back(w);
  }
  // A pipeline that continues when the others are gone keeps its outer
  // optimizer (its entry in pipeline_info), for the pipelines still to come.
  served.outer_ = job.has_outer() &&
                  (PipelinesOf(plan) > 1 || PipelineInfoOf(plan, pipeline) != nullptr);
  if (served.outer_) {
    for (const StageWorker& w : served.outer_peers_) {
      if (pipeline == 0 || w.pipeline == 0) served.outer_link_peers_.push_back(w);
    }
  }
  for (size_t i = 0; i < served.stage_workers_.size(); ++i) {
    if (served.stage_workers_[i].id == worker_id) served.replica_index_ = static_cast<int>(i);
  }
  // The default window is one microbatch in flight per worker of the
  // pipeline, routed replicas included (each of its stages derives the same
  // figure from the same plan).
  int pipeline_workers = 0;
  for (const v1::StageAssignment& s : plan.stages()) {
    pipeline_workers += static_cast<int>(WorkersOf(s, pipeline).size());
  }
  served.job_microbatches_ = job.microbatches();
  served.schedule_ = ConfigureSchedule(served.PipelineJob(job), pipeline_workers,
                                       plan.in_flight());
  served.activation_codec_ = stage + 1 < plan.stages_size()
                                 ? CapToLadder(mine->link_codec(), job.activation_codec())
                                 : job.activation_codec();
  served.gradient_codec_ =
      stage > 0 ? CapToLadder(plan.stages(stage - 1).link_codec(), job.gradient_codec())
                : job.gradient_codec();
  return served;
}

int ServedPlan::start_step() const {
  const v1::PipelineInfo* info = PipelineInfoOf(plan_, pipeline_);
  return info != nullptr ? info->start_step() : plan_.start_step();
}

int ServedPlan::data_stride() const {
  const v1::PipelineInfo* info = PipelineInfoOf(plan_, pipeline_);
  return info != nullptr ? std::max(1, info->data_stride()) : pipelines();
}

int ServedPlan::microbatches() const {
  const v1::PipelineInfo* info = PipelineInfoOf(plan_, pipeline_);
  return info != nullptr && info->microbatches() > 0 ? info->microbatches()
                                                     : static_cast<int>(job_microbatches_);
}

int64_t ServedPlan::data_block() const {
  const v1::PipelineInfo* info = PipelineInfoOf(plan_, pipeline_);
  return info != nullptr && info->data_block() > 0
             ? info->data_block()
             : static_cast<int64_t>(data_stride()) * microbatches();
}

v1::JobSpec ServedPlan::PipelineJob(const v1::JobSpec& job) const {
  v1::JobSpec mine = job;
  mine.set_microbatches(microbatches());
  return mine;
}

int ServedPlan::data_lane() const {
  const v1::PipelineInfo* info = PipelineInfoOf(plan_, pipeline_);
  return info != nullptr ? info->data_lane() : pipeline_;
}

bool ServedPlan::ContinuesIn(const ServedPlan& next) const {
  auto ids = [](const std::vector<StageWorker>& workers) {
    std::vector<std::string> out;
    for (const StageWorker& w : workers) out.push_back(w.id);
    return out;
  };
  return PipelineInfoOf(next.plan_, next.pipeline_) != nullptr &&
         PipelineInfoOf(plan_, pipeline_) != nullptr && next.epoch() == epoch() &&
         next.plan_epoch() > plan_epoch() && next.self_id_ == self_id_ &&
         next.stage_ == stage_ && next.pipeline_ == pipeline_ &&
         next.assignment().layer_begin() == assignment().layer_begin() &&
         next.assignment().layer_end() == assignment().layer_end() &&
         ids(next.upstream_) == ids(upstream_) && ids(next.downstream_) == ids(downstream_) &&
         next.start_step() == start_step() && next.data_base() == data_base() &&
         next.data_stride() == data_stride() && next.data_lane() == data_lane() &&
         next.microbatches() == microbatches() && next.data_block() == data_block() &&
         next.outer_ == outer_;
}

int64_t ServedPlan::data_base() const {
  if (const v1::PipelineInfo* info = PipelineInfoOf(plan_, pipeline_)) {
    return static_cast<int64_t>(info->data_base());
  }
  return plan_.has_data_base()
             ? static_cast<int64_t>(plan_.data_base())
             : static_cast<int64_t>(plan_.start_step()) * pipelines() * job_microbatches_;
}

StagePlacement ServedPlan::placement() const {
  const v1::StageAssignment& mine = assignment();
  return StagePlacement{stage_, num_stages(), mine.layer_begin(), mine.layer_end()};
}

const v1::PlannedLink* ServedPlan::LinkBetween(const std::string& upstream_worker,
                                               const std::string& downstream_worker) const {
  for (const v1::PlannedLink& link : plan_.links()) {
    if (link.upstream_worker() == upstream_worker &&
        link.downstream_worker() == downstream_worker) {
      return &link;
    }
  }
  return nullptr;
}

const v1::PlannedLink* ServedPlan::LinkTo(const StageWorker& peer, PeerSide side) const {
  return UpstreamEndOf(side) ? LinkBetween(self_id_, peer.id) : LinkBetween(peer.id, self_id_);
}

v1::LinkDialer ServedPlan::DialerBetween(const std::string& upstream_worker,
                                         const std::string& downstream_worker) const {
  const v1::PlannedLink* link = LinkBetween(upstream_worker, downstream_worker);
  return link == nullptr || link->dialer() == v1::LINK_DIALER_UNSPECIFIED
             ? v1::LINK_DIALER_UPSTREAM
             : link->dialer();
}

std::set<std::string> ServedPlan::DiallingDownstream() const {
  std::set<std::string> dialling;
  for (const StageWorker& next : downstream_) {
    if (DialerBetween(self_id_, next.id) == v1::LINK_DIALER_DOWNSTREAM) dialling.insert(next.id);
  }
  return dialling;
}

bool ServedPlan::activation_codec_planned() const {
  return assignment().link_codec() != v1::CODEC_UNSPECIFIED;
}

bool ServedPlan::gradient_codec_planned() const {
  return stage_ > 0 && plan_.stages(stage_ - 1).link_codec() != v1::CODEC_UNSPECIFIED;
}

}  // namespace geotrain
