#include "coordinator/planner.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

std::vector<LayerProfile> Uniform(int n, double flops = 1e9, uint64_t bytes = 100) {
  LayerProfile layer;
  layer.flops_per_sample = flops;
  layer.training_bytes = bytes;
  return std::vector<LayerProfile>(n, layer);
}

void ExpectContiguousCover(const std::vector<StageRange>& plan, int layers) {
  ASSERT_FALSE(plan.empty());
  EXPECT_EQ(plan.front().layer_begin, 0);
  EXPECT_EQ(plan.back().layer_end, layers);
  for (size_t k = 0; k < plan.size(); ++k) {
    EXPECT_LT(plan[k].layer_begin, plan[k].layer_end);
    if (k > 0) EXPECT_EQ(plan[k].layer_begin, plan[k - 1].layer_end);
  }
}

TEST(PlannerTest, EqualWorkersGetEqualShares) {
  auto plan = PlanStages(Uniform(6), {{"a", 10, 0}, {"b", 10, 0}, {"c", 10, 0}}, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectContiguousCover(*plan, 6);
  for (const StageRange& s : *plan) EXPECT_EQ(s.layer_end - s.layer_begin, 2);
  EXPECT_EQ((*plan)[0].worker_id, "a");
  EXPECT_EQ((*plan)[2].worker_id, "c");
}

TEST(PlannerTest, FasterWorkerGetsMoreLayers) {
  auto plan = PlanStages(Uniform(8), {{"slow", 10, 0}, {"fast", 30, 0}}, 0);
  ASSERT_TRUE(plan.ok());
  ExpectContiguousCover(*plan, 8);
  EXPECT_EQ((*plan)[0].layer_end - (*plan)[0].layer_begin, 2);
  EXPECT_EQ((*plan)[1].layer_end - (*plan)[1].layer_begin, 6);
}

TEST(PlannerTest, BalancesUnequalLayers) {
  std::vector<LayerProfile> layers = Uniform(5);
  layers[4].flops_per_sample = 4e9;  // a heavy head
  auto plan = PlanStages(layers, {{"a", 10, 0}, {"b", 10, 0}}, 0);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ((*plan)[1].layer_begin, 4);  // head alone on its stage
}

TEST(PlannerTest, RespectsMemory) {
  // Speed says give everything to "fast", but it holds only two layers.
  auto plan = PlanStages(Uniform(6, 1e9, 100), {{"fast", 100, 200}, {"slow", 1, 0}}, 0);
  ASSERT_TRUE(plan.ok());
  EXPECT_LE((*plan)[0].layer_end - (*plan)[0].layer_begin, 2);
}

TEST(PlannerTest, ReportsWhenNothingFits) {
  auto plan = PlanStages(Uniform(4, 1e9, 100), {{"a", 1, 150}, {"b", 1, 150}}, 0);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(PlannerTest, MoreWorkersThanLayersLeavesStandbys) {
  auto plan = PlanStages(Uniform(2),
                         {{"a", 1, 0}, {"b", 5, 0}, {"c", 3, 0}, {"d", 4, 0}}, 0);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->size(), 2u);
  // The two fastest, in join order.
  EXPECT_EQ((*plan)[0].worker_id, "b");
  EXPECT_EQ((*plan)[1].worker_id, "d");
}

TEST(PlannerTest, MaxStagesCapsStageCount) {
  auto plan = PlanStages(Uniform(6), {{"a", 1, 0}, {"b", 1, 0}, {"c", 1, 0}}, 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->size(), 2u);
  ExpectContiguousCover(*plan, 6);
}

TEST(PlannerTest, RefusesEmptyInputs) {
  EXPECT_FALSE(PlanStages({}, {{"a", 1, 0}}, 0).ok());
  EXPECT_FALSE(PlanStages(Uniform(3), {}, 0).ok());
}

}  // namespace
}  // namespace geotrain
