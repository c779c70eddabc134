#include "coordinator/plan_builder.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/adaptive_codec.h"
#include "common/job_spec.h"
#include "common/link_message.h"
#include "common/model_profile.h"

namespace geotrain {
namespace {

// Wire bytes per raw byte of each codec on float32 (block 64 for the
// integer codecs: one scale per block), and a CPU's encode + decode cost per
// raw byte, roughly as bench/codecs measures them here.
CodecCost CostOf(v1::Codec codec) {
  switch (codec) {
    case v1::CODEC_FP16:
      return {codec, "fp16", 0.5, 0.5e-9};
    case v1::CODEC_BF16:
      return {codec, "bf16", 0.5, 0.5e-9};
    case v1::CODEC_INT8:
      return {codec, "int8", 0.266, 1e-9};
    case v1::CODEC_INT4:
      return {codec, "int4", 0.141, 1.2e-9};
    case v1::CODEC_TOPK:
      return {codec, "topk", 0.2, 3e-9};
    default:
      return {v1::CODEC_NONE, "none", 1.0, 0};
  }
}

// The codec that names each step of the ladder (a link's codec in a plan);
// each direction maps it onto its own ladder.
constexpr v1::Codec kStepCodecs[] = {v1::CODEC_NONE, v1::CODEC_FP16, v1::CODEC_INT8,
                                     v1::CODEC_INT4};

int LadderStep(v1::Codec codec) { return static_cast<int>(CodecLadder(codec).size()) - 1; }

}  // namespace

absl::StatusOr<std::unique_ptr<Planner>> MakePlannerByName(const std::string& name) {
  if (name == "network") return MakeNetworkPlanner();
  if (name == "join-order") return MakeJoinOrderPlanner();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown planner \"", name, "\": use network or join-order"));
}

PlannerInput PlannerInputFor(const v1::JobSpec& job, const std::vector<WorkerRecord>& workers,
                             CodecChoice codecs) {
  PlannerInput in;
  for (const WorkerRecord& w : workers) {
    PlannerWorkerInfo info;
    info.id = w.id;
    info.name = w.name;
    info.gflops = w.device.matmul_gflops();
    info.memory_bytes = w.device.memory_bytes();
    info.reachable = !w.reachability.known() || w.reachability.reachable();
    info.seconds_per_sample = w.layer_seconds_per_sample;
    in.workers.push_back(std::move(info));
  }
  in.default_link = {0.001, 1e9};
  const std::vector<LayerProfile> layers = ProfileLayers(job);
  for (size_t l = 0; l < layers.size(); ++l) {
    PlannerLayer layer;
    layer.kind = layers[l].kind;
    layer.flops_per_sample = layers[l].flops_per_sample;
    layer.training_bytes = layers[l].training_bytes;
    layer.parameter_bytes = static_cast<uint64_t>(layers[l].parameter_count) * 4;
    if (l + 1 < layers.size()) {
      const TensorSpec spec = LayerInputSpec(job, static_cast<int>(l + 1), 1);
      uint64_t elements = 1;
      for (int64_t d : spec.shape) elements *= static_cast<uint64_t>(std::max<int64_t>(d, 1));
      layer.output_bytes_per_sample = elements * DTypeSize(spec.dtype);
    }
    in.layers.push_back(std::move(layer));
  }
  if (codecs == CodecChoice::kPerLink) {
    // One entry per step of the ladder, up to the stronger of the job's
    // two codecs; each direction takes its own ladder's codec at that step
    // (CapToLadder, as the workers do). The link costs the mean of what its
    // two directions send: in sync they cross it in turn, and a middle
    // worker's uplink carries one neighbour's activations and the other's
    // gradients. (The larger of the two would make a step that compresses
    // only gradients look worthless, and the planner would drop it.)
    const int steps = std::max(LadderStep(job.activation_codec()), LadderStep(job.gradient_codec()));
    for (int step = 0; step <= steps; ++step) {
      const v1::Codec codec = kStepCodecs[step];
      const CodecCost down = CostOf(CapToLadder(codec, job.activation_codec()));
      const CodecCost up = CostOf(CapToLadder(codec, job.gradient_codec()));
      in.codecs.push_back({codec, down.name == up.name ? down.name : down.name + "/" + up.name,
                           (down.ratio + up.ratio) / 2,
                           (down.seconds_per_byte + up.seconds_per_byte) / 2});
    }
  } else {
    in.codecs = {CostOf(job.activation_codec())};
  }
  in.schedule = job.schedule() == v1::SCHEDULE_SYNC ? PlannerSchedule::kSync
                                                    : PlannerSchedule::kAsync;
  in.microbatches = std::max(1, job.microbatches());
  in.microbatch_size = std::max(1, job.microbatch_size());
  in.max_stages = job.max_stages();
  // The job's own W, or what the workers accept from a plan.
  in.max_in_flight = job.in_flight() > 0 ? job.in_flight() : 32;
  // async-stash's gradients are as stale as the window is wide (2BW keeps
  // them one version old whatever W is). Measured with the demo GPT on 2
  // cores (bench/vs_ddp): 3 in flight on 2 stages took 1.38x the time of 2
  // to validation loss 2.6 at equal samples/s; W 5 on 3 stages, against
  // 3, trained 1.5% more samples/s and ended 300 steps at 2.693 where W 3
  // had reached 2.6 by 230. A job's own in_flight is taken as it is.
  if (job.schedule() == v1::SCHEDULE_ASYNC_STASH && job.in_flight() <= 0) {
    in.staleness_cost = kAsyncStashStalenessCost;
  }
  in.max_replicas = std::max(1, job.replicas());
  in.replica_sync_every = std::max(1, job.replica_sync_every());
  in.replica_ratio = CostOf(job.replica_codec()).ratio;
  if (job.has_outer()) {
    in.max_pipelines = PipelineCap(job);  // 0: as many as fit
    in.outer_split_batch = job.outer().split_batch();
    in.outer_inner_steps = std::max(1, job.outer().inner_steps());
    in.outer_ratio = CostOf(job.outer().codec()).ratio;
  }
  return in;
}

void CalibrateWithStageStats(const v1::Plan& plan, const std::vector<WorkerRecord>& workers,
                             PlannerInput* input) {
  const double batch = std::max(1, input->microbatch_size);
  std::vector<double> factor(workers.size(), 0);
  std::vector<double> known;
  for (const v1::StageAssignment& stage : plan.stages()) {
    for (size_t w = 0; w < workers.size(); ++w) {
      if (workers[w].id != stage.worker_id()) continue;
      const double measured = workers[w].stats.compute_s_per_microbatch();
      if (!(measured > 0)) continue;
      const PlannerWorkerInfo& info = input->workers[w];
      double predicted = 0;
      for (int l = stage.layer_begin(); l < stage.layer_end() &&
                                        l < static_cast<int>(input->layers.size()); ++l) {
        const PlannerLayer& layer = input->layers[l];
        auto it = info.seconds_per_sample.find(layer.kind);
        predicted += (it != info.seconds_per_sample.end()
                          ? it->second
                          : layer.flops_per_sample / (std::max(info.gflops, 1e-6) * 1e9)) *
                     batch;
      }
      if (!(predicted > 0)) continue;
      factor[w] = std::clamp(measured / predicted, 0.1, 10.0);
      known.push_back(factor[w]);
    }
  }
  if (known.empty()) return;
  std::sort(known.begin(), known.end());
  const double median = known[known.size() / 2];
  for (size_t w = 0; w < workers.size(); ++w) {
    const double f = factor[w] > 0 ? factor[w] : median;
    PlannerWorkerInfo& info = input->workers[w];
    for (auto& [kind, seconds] : info.seconds_per_sample) seconds *= f;
    info.gflops /= f;
  }
}

v1::Plan PlanProtoFor(const PipelinePlan& plan, const PlannerInput& input,
                      const std::vector<WorkerRecord>& workers) {
  v1::Plan proto;
  proto.set_num_layers(static_cast<int>(input.layers.size()));
  // Only the network planner chooses W and codecs; join order keeps
  // today's defaults (the job's W and codecs).
  const bool chosen = plan.planner == "network";
  if (chosen) proto.set_in_flight(plan.in_flight);
  if (plan.pipelines > 1) proto.set_pipelines(plan.pipelines);
  for (size_t k = 0; k < plan.stages.size(); ++k) {
    const PlannedStageInfo& s = plan.stages[k];
    v1::StageAssignment* stage = proto.add_stages();
    stage->set_stage(static_cast<int>(k));
    stage->set_layer_begin(s.layer_begin);
    stage->set_layer_end(s.layer_end);
    stage->set_worker_id(workers[s.worker].id);
    stage->set_address(workers[s.worker].address);
    for (int r : s.replicas) {
      v1::Replica* replica = stage->add_replicas();
      replica->set_worker_id(workers[r].id);
      replica->set_address(workers[r].address);
    }
    for (size_t p = 0; p < s.pipeline_workers.size(); ++p) {
      v1::Replica* replica = stage->add_replicas();
      replica->set_worker_id(workers[s.pipeline_workers[p]].id);
      replica->set_address(workers[s.pipeline_workers[p]].address);
      replica->set_pipeline(static_cast<int>(p) + 1);
    }
    if (chosen && k < plan.links.size()) {
      const int c = plan.links[k].codec_index;
      if (c >= 0 && c < static_cast<int>(input.codecs.size())) {
        stage->set_link_codec(static_cast<v1::Codec>(input.codecs[c].codec));
      }
    }
  }
  return proto;
}

absl::StatusOr<ReplanComparison> CompareForReplan(
    const v1::JobSpec& job, const PlannerInput& input, const std::vector<WorkerRecord>& workers,
    const v1::Plan& current, const PipelinePlan& best,
    const std::map<int, std::vector<int>>& checkpointed, int step) {
  ReplanComparison out;
  // Who holds each layer's state now: its stage's worker and replicas.
  std::map<int, std::set<std::string>> holders_now;
  for (const v1::StageAssignment& stage : current.stages()) {
    auto it = std::find_if(workers.begin(), workers.end(),
                           [&](const WorkerRecord& w) { return w.id == stage.worker_id(); });
    if (it == workers.end()) {
      return absl::NotFoundError(absl::StrCat(stage.worker_id(), " is not a candidate"));
    }
    PlannedStageInfo s;
    s.worker = static_cast<int>(it - workers.begin());
    s.layer_begin = stage.layer_begin();
    s.layer_end = stage.layer_end();
    // With pipelines, a stage's "replicas" are its workers in the other
    // pipelines, numbered 1..R-1.
    std::map<int, int> in_pipeline;
    for (const v1::Replica& replica : stage.replicas()) {
      auto r = std::find_if(workers.begin(), workers.end(),
                            [&](const WorkerRecord& w) { return w.id == replica.worker_id(); });
      if (replica.pipeline() > 0) {
        if (r == workers.end()) {
          return absl::NotFoundError(absl::StrCat(replica.worker_id(), " is not a candidate"));
        }
        in_pipeline[replica.pipeline()] = static_cast<int>(r - workers.begin());
      } else if (r != workers.end()) {
        s.replicas.push_back(static_cast<int>(r - workers.begin()));
      }
    }
    for (int p = 1; p < std::max(1, current.pipelines()); ++p) {
      auto worker = in_pipeline.find(p);
      if (worker == in_pipeline.end()) {
        return absl::FailedPreconditionError(
            absl::StrCat("stage ", stage.stage(), " has no worker in pipeline ", p));
      }
      s.pipeline_workers.push_back(worker->second);
    }
    out.current.stages.push_back(s);
    for (int l = stage.layer_begin(); l < stage.layer_end(); ++l) {
      holders_now[l].insert(stage.worker_id());
      for (const v1::Replica& replica : stage.replicas()) {
        holders_now[l].insert(replica.worker_id());
      }
    }
  }
  out.current.pipelines = std::max(1, current.pipelines());
  // The current links keep the codecs they run with (the ladder's entry).
  out.current.links.resize(out.current.stages.empty() ? 0 : out.current.stages.size() - 1);
  for (size_t k = 0; k < out.current.links.size(); ++k) {
    // Unspecified: the job's codecs, the ladder's last step.
    const v1::Codec codec = current.stages(static_cast<int>(k)).link_codec();
    const int step = codec == v1::CODEC_UNSPECIFIED
                         ? static_cast<int>(input.codecs.size()) - 1
                         : LadderStep(codec);
    out.current.links[k].codec_index =
        std::clamp(step, 0, std::max(0, static_cast<int>(input.codecs.size()) - 1));
  }
  // The current plan at the window its workers run (the planner may have
  // chosen one narrower than the round trip's, for staleness).
  PlannerInput at_its_window = input;
  if (current.in_flight() > 0) {
    at_its_window.max_in_flight = input.max_in_flight > 0
                                      ? std::min(input.max_in_flight, current.in_flight())
                                      : current.in_flight();
  }
  if (absl::Status scored = ScorePlan(at_its_window, &out.current); !scored.ok()) return scored;
  ReplanCandidate& candidate = out.candidate;
  // Compared as the planner chose: samples/s over the staleness they cost.
  candidate.current_s_per_sample = GoodputSecondsPerSample(input, out.current);
  candidate.best_s_per_sample = GoodputSecondsPerSample(input, best);
  candidate.move_rate_bps = 0;
  for (const PlannedLinkInfo& link : best.links) {
    const double ratio =
        link.codec_index >= 0 && link.codec_index < static_cast<int>(input.codecs.size())
            ? input.codecs[link.codec_index].ratio
            : 1.0;
    const double rate = link.transfer_s > 0 ? link.raw_bytes * ratio * 8 / link.transfer_s : 0;
    if (rate > 0 && (candidate.move_rate_bps == 0 || rate < candidate.move_rate_bps)) {
      candidate.move_rate_bps = rate;
    }
  }
  if (candidate.move_rate_bps == 0) candidate.move_rate_bps = input.default_link.rate_bps;
  const std::vector<LayerProfile> profile = ProfileLayers(job);
  // Every worker of the best plan (a new replica too) receives the layers
  // it does not hold yet.
  for (const PlannedStageInfo& s : best.stages) {
    std::vector<int> crew = {s.worker};
    crew.insert(crew.end(), s.replicas.begin(), s.replicas.end());
    crew.insert(crew.end(), s.pipeline_workers.begin(), s.pipeline_workers.end());
    for (int w : crew) {
      for (int l = s.layer_begin; l < s.layer_end && l < static_cast<int>(profile.size()); ++l) {
        if (holders_now[l].count(workers[w].id) > 0) continue;
        candidate.move_bytes += profile[l].parameter_count * 4.0 * 3;  // weights, Adam's m and v
        auto it = checkpointed.find(l);
        if (it == checkpointed.end() || it->second.empty() || it->second.back() < step - 1) {
          candidate.state_fresh = false;
        }
      }
    }
  }
  return out;
}

std::string SummaryOf(const PipelinePlan& plan, const std::vector<WorkerRecord>& workers) {
  std::string summary;
  for (size_t k = 0; k < plan.stages.size(); ++k) {
    const PlannedStageInfo& s = plan.stages[k];
    const WorkerRecord& w = workers[s.worker];
    absl::StrAppend(&summary, k == 0 ? "" : ", ", "stage ", k, " = layers [", s.layer_begin, ",",
                    s.layer_end, ") on ", w.name.empty() ? w.id : w.name);
    for (int r : s.replicas) {
      const WorkerRecord& replica = workers[r];
      absl::StrAppend(&summary, " + ", replica.name.empty() ? replica.id : replica.name,
                      " (replica)");
    }
    for (size_t p = 0; p < s.pipeline_workers.size(); ++p) {
      const WorkerRecord& other = workers[s.pipeline_workers[p]];
      absl::StrAppend(&summary, " + ", other.name.empty() ? other.id : other.name,
                      " (pipeline ", p + 1, ")");
    }
  }
  return summary;
}

v1::PlanPrediction PredictionOf(const PlannerInput& input, const PipelinePlan& plan) {
  v1::PlanPrediction prediction;
  prediction.set_planner(plan.planner);
  prediction.set_time_per_sample_s(plan.predicted_s_per_sample > 0 ? plan.predicted_s_per_sample
                                                                    : plan.time_per_sample_s);
  prediction.set_bottleneck_s(plan.bottleneck_s);
  prediction.set_in_flight(plan.in_flight);
  prediction.set_bound(plan.bound);
  prediction.set_explanation(ExplainPlan(input, plan));
  prediction.set_exact(plan.exact);
  return prediction;
}

}  // namespace geotrain
