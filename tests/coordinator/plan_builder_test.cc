#include "coordinator/plan_builder.h"

#include <gtest/gtest.h>

#include "common/job_spec.h"

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
  EXPECT_DOUBLE_EQ(in.workers[0].seconds_per_sample.at("block"), 0.002);
  EXPECT_FALSE(in.workers[1].reachable);
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

}  // namespace
}  // namespace geotrain
