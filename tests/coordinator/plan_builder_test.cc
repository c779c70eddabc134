#include "coordinator/plan_builder.h"

#include <gtest/gtest.h>

#include "common/job_spec.h"
#include "common/model_profile.h"

namespace geotrain {
namespace {

TEST(PlanBuilderTest, InputsComeFromTheJobAndTheMembers) {
  auto job = ParseJobSpec(
      "gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 microbatch_size: 4 "
      "microbatches: 3 schedule: SCHEDULE_ASYNC_STASH",
      "test");
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<WorkerRecord> workers(2);
  workers[0].id = "w0";
  workers[0].device.set_matmul_gflops(10);
  workers[0].layer_seconds_per_sample = {{"block", 0.002}};
  workers[1].id = "w1";
  workers[1].device.set_matmul_gflops(20);
  workers[1].reachability.set_known(true);
  workers[1].reachability.set_reachable(false);
  const PlannerInput in = PlannerInputFor(*job, workers);
  ASSERT_EQ(in.layers.size(), 4u);
  EXPECT_EQ(in.layers[0].kind, "embed");
  EXPECT_EQ(in.layers[1].kind, "block");
  EXPECT_EQ(in.layers[3].kind, "head");
  // The activation leaving the embedding: context x d_model floats.
  EXPECT_EQ(in.layers[0].output_bytes_per_sample, 8u * 16 * 4);
  EXPECT_EQ(in.schedule, PlannerSchedule::kAsync);
  EXPECT_EQ(in.microbatch_size, 4);
  EXPECT_EQ(in.max_in_flight, 32);
  EXPECT_DOUBLE_EQ(in.staleness_cost, kAsyncStashStalenessCost);
  EXPECT_DOUBLE_EQ(in.workers[0].seconds_per_sample.at("block"), 0.002);
  EXPECT_FALSE(in.workers[1].reachable);
  // The job's own W is taken as it is; sync has no staleness.
  v1::JobSpec windowed = *job;
  windowed.set_in_flight(4);
  EXPECT_EQ(PlannerInputFor(windowed, workers).staleness_cost, 0);
  v1::JobSpec sync = *job;
  sync.set_schedule(v1::SCHEDULE_SYNC);
  EXPECT_EQ(PlannerInputFor(sync, workers).staleness_cost, 0);
}

TEST(PlanBuilderTest, StageStatsCalibrateTheLayerTimes) {
  auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} "
                          "steps: 3 microbatch_size: 4",
                          "test");
  ASSERT_TRUE(job.ok());
  std::vector<WorkerRecord> workers(3);
  for (int i = 0; i < 3; ++i) {
    workers[i].id = "w" + std::to_string(i);
    workers[i].device.set_matmul_gflops(10);
    workers[i].layer_seconds_per_sample = {{"embed", 0.001}, {"block", 0.001}, {"head", 0.001}};
  }
  // w0 runs layers [0,2): predicted 2 x 1 ms x 4 samples = 8 ms; it measures 24.
  workers[0].stats.set_compute_s_per_microbatch(0.024);
  v1::Plan plan;
  v1::StageAssignment* stage = plan.add_stages();
  stage->set_worker_id("w0");
  stage->set_layer_begin(0);
  stage->set_layer_end(2);
  PlannerInput in = PlannerInputFor(*job, workers);
  CalibrateWithStageStats(plan, workers, &in);
  EXPECT_NEAR(in.workers[0].seconds_per_sample.at("block"), 0.003, 1e-12);
  // The others have no stage: they take the median factor (3x).
  EXPECT_NEAR(in.workers[2].seconds_per_sample.at("head"), 0.003, 1e-12);
  // An absurd report is bounded.
  workers[0].stats.set_compute_s_per_microbatch(1e6);
  in = PlannerInputFor(*job, workers);
  CalibrateWithStageStats(plan, workers, &in);
  EXPECT_NEAR(in.workers[0].seconds_per_sample.at("block"), 0.010, 1e-12);
}

TEST(PlanBuilderTest, PerLinkCodecsAreTheLadderUpToTheJobsCodecs) {
  auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
                          "activation_codec: CODEC_INT8 gradient_codec: CODEC_INT8",
                          "test");
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<WorkerRecord> workers(2);
  auto names = [](const PlannerInput& in) {
    std::vector<std::string> out;
    for (const CodecCost& c : in.codecs) out.push_back(c.name);
    return out;
  };
  EXPECT_EQ(names(PlannerInputFor(*job, workers)), std::vector<std::string>{"int8"});
  PlannerInput in = PlannerInputFor(*job, workers, CodecChoice::kPerLink);
  EXPECT_EQ(names(in), (std::vector<std::string>{"none", "fp16", "int8"}));
  EXPECT_GT(in.codecs[0].ratio, in.codecs[1].ratio);
  EXPECT_GT(in.codecs[1].ratio, in.codecs[2].ratio);
  // Gradients compressed, activations not: each step still shrinks what
  // the link carries (the mean of its two directions).
  job->set_activation_codec(v1::CODEC_NONE);
  in = PlannerInputFor(*job, workers, CodecChoice::kPerLink);
  EXPECT_EQ(names(in), (std::vector<std::string>{"none", "none/fp16", "none/int8"}));
  EXPECT_DOUBLE_EQ(in.codecs[0].ratio, 1.0);
  EXPECT_GT(in.codecs[0].ratio, in.codecs[1].ratio);
  EXPECT_GT(in.codecs[1].ratio, in.codecs[2].ratio);
  EXPECT_GT(in.codecs[2].ratio, 0.5);  // the activations still go raw
  // The job's defaults (none both ways): nothing to choose.
  job->set_gradient_codec(v1::CODEC_NONE);
  EXPECT_EQ(names(PlannerInputFor(*job, workers, CodecChoice::kPerLink)),
            std::vector<std::string>{"none"});
}

TEST(PlanBuilderTest, OnlyGradientsCompressedStillCompressTheSlowLink) {
  // Activations raw, gradients int8: a slow link gets the ladder's int8
  // step (none one way, int8 the other), a fast one none at all.
  auto job = ParseJobSpec("gpt { context: 64 d_model: 64 heads: 2 blocks: 2 } text {} steps: 3 "
                          "gradient_codec: CODEC_INT8 microbatch_size: 8",
                          "test");
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<WorkerRecord> workers(2);
  for (int i = 0; i < 2; ++i) {
    workers[i].id = "w" + std::to_string(i);
    workers[i].device.set_matmul_gflops(10);
    workers[i].layer_seconds_per_sample = {{"embed", 1e-4}, {"block", 0.08}, {"head", 1e-3}};
  }
  // 16 KiB of activations per sample; a stage takes about 81 ms a sample.
  // At 1.1 Mb/s raw they would take 119 ms, with the fp16 step (a mean of
  // 0.75) 89 ms, with the int8 step 75 ms: only int8 keeps up.
  PlannerInput in = PlannerInputFor(*job, workers, CodecChoice::kPerLink);
  in.max_stages = 2;
  auto link_codec = [&](double rate_bps) {
    in.links.assign(4, {0.001, rate_bps});
    absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok() || plan->stages.size() != 2) return v1::CODEC_UNSPECIFIED;
    return PlanProtoFor(*plan, in, workers).stages(0).link_codec();
  };
  EXPECT_EQ(link_codec(10e9), v1::CODEC_NONE);
  EXPECT_EQ(link_codec(1.1e6), v1::CODEC_INT8);
}

TEST(PlanBuilderTest, TheNetworkPlansCodecsAndWindowTravelWithThePlan) {
  auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
                          "activation_codec: CODEC_INT8 gradient_codec: CODEC_INT8",
                          "test");
  ASSERT_TRUE(job.ok());
  std::vector<WorkerRecord> workers(3);
  for (int i = 0; i < 3; ++i) workers[i].id = "w" + std::to_string(i);
  const PlannerInput in = PlannerInputFor(*job, workers, CodecChoice::kPerLink);
  PipelinePlan plan;
  plan.planner = "network";
  plan.in_flight = 5;
  plan.stages = {{2, 0, 1}, {0, 1, 3}, {1, 3, 4}};
  plan.links.resize(2);
  plan.links[0].codec_index = 0;
  plan.links[1].codec_index = 2;
  v1::Plan proto = PlanProtoFor(plan, in, workers);
  EXPECT_EQ(proto.num_layers(), 4);
  EXPECT_EQ(proto.in_flight(), 5);
  ASSERT_EQ(proto.stages_size(), 3);
  EXPECT_EQ(proto.stages(0).worker_id(), "w2");
  EXPECT_EQ(proto.stages(0).link_codec(), v1::CODEC_NONE);
  EXPECT_EQ(proto.stages(1).link_codec(), v1::CODEC_INT8);
  EXPECT_EQ(proto.stages(2).link_codec(), v1::CODEC_UNSPECIFIED);  // no link after the last
  // Join order chooses neither: the job's codecs and W apply.
  plan.planner = "join-order";
  proto = PlanProtoFor(plan, in, workers);
  EXPECT_EQ(proto.in_flight(), 0);
  EXPECT_EQ(proto.stages(1).link_codec(), v1::CODEC_UNSPECIFIED);
}

TEST(PlanBuilderTest, AReplanComparisonRescoresTheCurrentPlanAndCostsTheMove) {
  auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 30",
                          "test");
  ASSERT_TRUE(job.ok());
  std::vector<WorkerRecord> workers(3);
  for (int i = 0; i < 3; ++i) {
    workers[i].id = "w" + std::to_string(i);
    workers[i].layer_seconds_per_sample = {{"embed", 0.001}, {"block", 0.001}, {"head", 0.001}};
  }
  PlannerInput in = PlannerInputFor(*job, workers, CodecChoice::kPerLink);
  v1::Plan current;
  for (auto [id, begin, end] : {std::tuple{"w0", 0, 2}, std::tuple{"w1", 2, 4}}) {
    v1::StageAssignment* stage = current.add_stages();
    stage->set_worker_id(id);
    stage->set_layer_begin(begin);
    stage->set_layer_end(end);
  }
  // The best plan moves layer 1 to w2 and layers 2-3 stay on w1.
  PipelinePlan best;
  best.stages = {{0, 0, 1}, {2, 1, 2}, {1, 2, 4}};
  ASSERT_TRUE(ScorePlan(in, &best).ok());
  const std::vector<LayerProfile> profile = ProfileLayers(*job);
  std::map<int, std::vector<int>> checkpointed = {{1, {5, 9}}};
  absl::StatusOr<ReplanComparison> compared =
      CompareForReplan(*job, in, workers, current, best, checkpointed, /*step=*/10);
  ASSERT_TRUE(compared.ok()) << compared.status();
  EXPECT_EQ(compared->current.stages.size(), 2u);
  EXPECT_GT(compared->candidate.current_s_per_sample, 0);
  EXPECT_EQ(compared->candidate.best_s_per_sample, best.time_per_sample_s);
  EXPECT_DOUBLE_EQ(compared->candidate.move_bytes, profile[1].parameter_count * 12.0);
  EXPECT_TRUE(compared->candidate.state_fresh);  // layer 1's checkpoint is one step old
  EXPECT_NEAR(compared->candidate.move_rate_bps, 1e9, 1e3);  // the default link
  compared = CompareForReplan(*job, in, workers, current, best, checkpointed, /*step=*/11);
  ASSERT_TRUE(compared.ok());
  EXPECT_FALSE(compared->candidate.state_fresh);
  // A new replica receives its stage's state too: w1 replicating layer 1
  // doubles the move.
  PipelinePlan replicated = best;
  replicated.stages[1].replicas = {1};
  ASSERT_TRUE(ScorePlan(in, &replicated).ok());
  compared = CompareForReplan(*job, in, workers, current, replicated, checkpointed, 10);
  ASSERT_TRUE(compared.ok());
  EXPECT_DOUBLE_EQ(compared->candidate.move_bytes, profile[1].parameter_count * 24.0);
  // A worker that holds a layer as a replica now moves nothing to keep it.
  current.mutable_stages(0)->add_replicas()->set_worker_id("w2");
  compared = CompareForReplan(*job, in, workers, current, best, checkpointed, 10);
  ASSERT_TRUE(compared.ok());
  EXPECT_DOUBLE_EQ(compared->candidate.move_bytes, 0);
  current.mutable_stages(0)->clear_replicas();
  // A worker of the current plan that is no candidate any more: a failure,
  // not a voluntary move.
  current.mutable_stages(1)->set_worker_id("gone");
  EXPECT_EQ(CompareForReplan(*job, in, workers, current, best, checkpointed, 10).status().code(),
            absl::StatusCode::kNotFound);
  // The current plan is scored at the window its workers run, not the one
  // that would cover its round trip.
  current.mutable_stages(1)->set_worker_id("w1");
  PlannerInput async = in;
  async.schedule = PlannerSchedule::kAsync;
  compared = CompareForReplan(*job, async, workers, current, best, checkpointed, 10);
  ASSERT_TRUE(compared.ok());
  const int covering = compared->current.in_flight;
  ASSERT_GT(covering, 2);
  current.set_in_flight(2);
  compared = CompareForReplan(*job, async, workers, current, best, checkpointed, 10);
  ASSERT_TRUE(compared.ok());
  EXPECT_EQ(compared->current.in_flight, 2);
}

}  // namespace
}  // namespace geotrain
