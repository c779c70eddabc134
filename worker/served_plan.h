// The part of a plan one worker serves: its stage, its neighbours and how
// each link is opened, the codecs of its links, the schedule and its place
// among the stage's workers. Derived once per plan epoch, checked, and
// read by the worker session; pure data (no I/O), so a test builds one
// from a hand-made plan.
#ifndef GEOTRAIN_WORKER_SERVED_PLAN_H_
#define GEOTRAIN_WORKER_SERVED_PLAN_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/plan_util.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"
#include "worker/message_sink.h"
#include "worker/pipeline_driver.h"
#include "worker/stage_runtime.h"

namespace geotrain {

class ServedPlan {
 public:
  // NOT_FOUND when `plan` gives `worker_id` no stage (a standby).
  static absl::StatusOr<ServedPlan> For(const v1::Plan& plan, const v1::JobSpec& job,
                                        const std::string& worker_id);

  const v1::Plan& plan() const { return plan_; }
  const v1::StageAssignment& assignment() const { return plan_.stages(stage()); }
  const std::string& self_id() const { return self_id_; }
  // The epoch this worker's session, links and reports carry: the one its
  // pipeline was formed in (Plan.pipeline_info), which stays while the
  // pipeline continues through later plans; else the plan's.
  uint64_t epoch() const { return SessionEpochOf(plan_, pipeline_); }
  uint64_t plan_epoch() const { return plan_.epoch(); }
  int stage() const { return stage_; }
  int num_stages() const { return plan_.stages_size(); }
  // The step this worker's pipeline resumes after.
  int start_step() const;
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ + 1 == num_stages(); }
  StagePlacement placement() const;
  // The window and update rule every stage of the plan derives alike.
  const ScheduleConfig& schedule() const { return schedule_; }

  // R, and the pipeline this worker serves its stage in.
  int pipelines() const { return PipelinesOf(plan_); }
  int pipeline() const { return pipeline_; }
  // The workers of this pipeline on the stage before, the stage after and
  // this one (the stage's workers routed to within the pipeline, its
  // first listed first), as the plan lists them.
  const std::vector<StageWorker>& upstream() const { return upstream_; }
  const std::vector<StageWorker>& downstream() const { return downstream_; }
  const std::vector<StageWorker>& stage_workers() const { return stage_workers_; }
  // This stage's workers in the other pipelines: the outer step's peers.
  const std::vector<StageWorker>& outer_peers() const { return outer_peers_; }
  // Whether the stage's replicas take outer steps (job.outer, R > 1).
  bool outer() const { return outer_; }
  // The replicas this worker holds an outer-sync link with: the outer
  // sync is a star around the stage's reducer, its worker in pipeline 0,
  // so the reducer's are every other replica and a replica's the reducer.
  const std::vector<StageWorker>& outer_link_peers() const { return outer_link_peers_; }
  // The planned link to `peer` on `side` (an outer-sync link: between the
  // contributing replica and the reducer, whichever this worker is); null
  // when the plan lists none.
  const v1::PlannedLink* LinkTo(const StageWorker& peer, PeerSide side) const;
  // Whether this worker plays that link's upstream end (see
  // PlaysUpstreamEnd in link_dialer.h).
  bool UpstreamEndOf(PeerSide side) const {
    return side == PeerSide::kDownstream || (side == PeerSide::kReplica && pipeline_ != 0);
  }
  // This worker's place among its pipeline's workers of the stage.
  int replica_index() const { return replica_index_; }
  // The stage's primary: it uploads the stage's checkpoints.
  bool primary() const { return primary_; }
  // Routed replicas within the pipeline (gossip averaging).
  bool replicated() const { return stage_workers_.size() > 1; }
  // This pipeline's data (StageRuntime::SetDataShard): the index of
  // start_step's first microbatch, the stride between a step's
  // microbatches, and this pipeline's lane among them.
  int64_t data_base() const;
  int data_stride() const;
  int data_lane() const;
  // This pipeline's microbatches a step (its share of the job's M with
  // OuterOptimizer.split_batch, else M) and the data indices a step spans
  // (M split, else data_stride x M).
  int microbatches() const;
  int64_t data_block() const;
  // `job` as this pipeline runs it: its microbatches a step.
  v1::JobSpec PipelineJob(const v1::JobSpec& job) const;
  // The epoch of the outer-sync link with `peer` (the later of the two
  // pipelines').
  uint64_t OuterLinkEpoch(const StageWorker& peer) const {
    return OuterLinkEpochOf(plan_, pipeline_, peer.pipeline);
  }
  // Whether a session serving this plan goes on, untouched, in `next`: its
  // pipeline continues there (the same number and formed epoch, so the
  // coordinator found its chain unchanged), with this worker on the same
  // stage between the same neighbours. Only the outer-sync peers and the
  // plan's epoch may differ.
  bool ContinuesIn(const ServedPlan& next) const;

  // The plan's link between two workers; null when it lists none (an older
  // coordinator: the upstream end dials).
  const v1::PlannedLink* LinkBetween(const std::string& upstream_worker,
                                     const std::string& downstream_worker) const;
  // Who opens that link.
  v1::LinkDialer DialerBetween(const std::string& upstream_worker,
                               const std::string& downstream_worker) const;
  // The next stage's workers that dial this one.
  std::set<std::string> DiallingDownstream() const;

  // The codecs of this worker's outgoing activations and gradients: the
  // plan's for each link (the network planner compresses only the links
  // that bind), each on its own ladder and never past the job's.
  v1::Codec activation_codec() const { return activation_codec_; }
  v1::Codec gradient_codec() const { return gradient_codec_; }
  // Whether the plan chose them (else the job fixed them).
  bool activation_codec_planned() const;
  bool gradient_codec_planned() const;

 private:
  ServedPlan() = default;

  v1::Plan plan_;
  std::string self_id_;
  int stage_ = 0;
  int pipeline_ = 0;
  int replica_index_ = 0;
  bool primary_ = true;
  ScheduleConfig schedule_;
  int64_t job_microbatches_ = 1;  // job.microbatches
  std::vector<StageWorker> upstream_, downstream_, stage_workers_, outer_peers_;
  std::vector<StageWorker> outer_link_peers_;
  bool outer_ = false;
  v1::Codec activation_codec_ = v1::CODEC_UNSPECIFIED;
  v1::Codec gradient_codec_ = v1::CODEC_UNSPECIFIED;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_SERVED_PLAN_H_
