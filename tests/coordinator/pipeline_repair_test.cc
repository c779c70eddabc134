#include "coordinator/pipeline_repair.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

// Three pipelines of two stages: aR on stage 0, bR on stage 1.
v1::Plan ThreePipelines() {
  v1::Plan plan;
  plan.set_pipelines(3);
  for (const char* prefix : {"a", "b"}) {
    v1::StageAssignment* stage = plan.add_stages();
    stage->set_stage(plan.stages_size() - 1);
    std::vector<StageWorker> workers;
    for (int r = 0; r < 3; ++r) {
      const std::string id = prefix + std::to_string(r);
      workers.push_back({id, id + ":1", r});
    }
    SetStageWorkers(stage, workers);
  }
  return plan;
}

std::set<std::string> AllBut(const std::string& lost) {
  std::set<std::string> live;
  for (const char* id : {"a0", "a1", "a2", "b0", "b1", "b2"}) {
    if (id != lost) live.insert(id);
  }
  return live;
}

std::string Name(const std::string& id) { return id; }

TEST(PipelineRepairTest, NothingLostNothingChanges) {
  PipelineRepair repair = RepairPipelines(ThreePipelines(), AllBut(""), {}, Name);
  EXPECT_FALSE(repair.changed);
}

TEST(PipelineRepairTest, AStandbyTakesTheLostPlaceInItsPipeline) {
  PipelineRepair repair = RepairPipelines(ThreePipelines(), AllBut("b1"), {{"s", "s:1"}}, Name);
  ASSERT_TRUE(repair.changed);
  EXPECT_EQ(repair.plan.pipelines(), 3);
  const std::vector<StageWorker> pipeline1 = WorkersOf(repair.plan.stages(1), 1);
  ASSERT_EQ(pipeline1.size(), 1u);
  EXPECT_EQ(pipeline1[0].id, "s");
  // The other pipelines are untouched.
  EXPECT_EQ(WorkersOf(repair.plan.stages(1), 0)[0].id, "b0");
  EXPECT_EQ(WorkersOf(repair.plan.stages(1), 2)[0].id, "b2");
  EXPECT_NE(repair.summary.find("b1 lost -> s (standby)"), std::string::npos) << repair.summary;
}

TEST(PipelineRepairTest, WithoutAStandbyOnlyTheLostWorkersPipelineIsDissolved) {
  PipelineRepair repair = RepairPipelines(ThreePipelines(), AllBut("a0"), {}, Name);
  ASSERT_TRUE(repair.changed);
  EXPECT_EQ(repair.plan.pipelines(), 2);
  // Pipeline 0 went: pipeline 1 is now 0 (its workers the primaries), 2 is 1.
  EXPECT_EQ(repair.plan.stages(0).worker_id(), "a1");
  EXPECT_EQ(repair.plan.stages(0).pipeline(), 0);
  EXPECT_EQ(repair.plan.stages(1).worker_id(), "b1");
  EXPECT_EQ(WorkersOf(repair.plan.stages(1), 1)[0].id, "b2");
  EXPECT_EQ(WorkersInPlan(repair.plan), 4);  // b0 stands by
  EXPECT_NE(repair.summary.find("pipeline 0 dissolved"), std::string::npos) << repair.summary;
}

TEST(PipelineRepairTest, TheLastTwoPipelinesBecomeOne) {
  v1::Plan plan = ThreePipelines();
  PipelineRepair first = RepairPipelines(plan, AllBut("b2"), {}, Name);
  std::set<std::string> live = AllBut("b2");
  live.erase("a1");
  PipelineRepair second = RepairPipelines(first.plan, live, {}, Name);
  ASSERT_TRUE(second.changed);
  EXPECT_EQ(PipelinesOf(second.plan), 1);
  EXPECT_LE(second.plan.pipelines(), 1);
  EXPECT_EQ(WorkersInPlan(second.plan), 2);
}

TEST(PipelineRepairTest, NoneLeftWhenEveryPipelineLostAStage) {
  std::set<std::string> live = {"a0", "b1", "a2"};
  PipelineRepair repair = RepairPipelines(ThreePipelines(), live, {}, Name);
  EXPECT_TRUE(repair.none_left);
}

}  // namespace
}  // namespace geotrain
