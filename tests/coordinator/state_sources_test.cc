#include "coordinator/state_sources.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

// stages: {primary, replicas...} per stage, layers [2i, 2i+2).
v1::Plan PlanOf(const std::vector<std::vector<std::string>>& stages) {
  v1::Plan plan;
  for (size_t i = 0; i < stages.size(); ++i) {
    v1::StageAssignment* s = plan.add_stages();
    s->set_stage(static_cast<int>(i));
    s->set_layer_begin(2 * static_cast<int>(i));
    s->set_layer_end(2 * static_cast<int>(i) + 2);
    s->set_worker_id(stages[i][0]);
    s->set_address(stages[i][0] + ":1");
    for (size_t r = 1; r < stages[i].size(); ++r) {
      v1::Replica* replica = s->add_replicas();
      replica->set_worker_id(stages[i][r]);
      replica->set_address(stages[i][r] + ":1");
    }
  }
  return plan;
}

TEST(StateSourcesTest, ANewReplicaTakesTheStageFromALiveReplica) {
  const v1::Plan before = PlanOf({{"a"}, {"b", "c"}, {"d"}});
  v1::Plan next = PlanOf({{"a"}, {"b", "c", "e"}, {"d"}});
  AssignStateSources(&before, &next);
  EXPECT_FALSE(next.stages(0).has_state_source());
  EXPECT_FALSE(next.stages(2).has_state_source());
  const v1::StateSource& source = next.stages(1).state_source();
  EXPECT_EQ(source.worker_id(), "c");  // the replica, not the primary
  EXPECT_EQ(source.address(), "c:1");
  ASSERT_EQ(source.for_workers_size(), 1);
  EXPECT_EQ(source.for_workers(0), "e");
}

TEST(StateSourcesTest, TheOwnerServesWhenItHasNoReplica) {
  const v1::Plan before = PlanOf({{"a"}, {"b"}, {"d"}});
  v1::Plan next = PlanOf({{"a"}, {"b", "e"}, {"d"}});
  AssignStateSources(&before, &next);
  EXPECT_EQ(next.stages(1).state_source().worker_id(), "b");
}

// Pipelines: pipeline 1 was dissolved (its workers stood by) and is formed
// anew from them and a newcomer. None of them fetches from pipeline 0's
// workers, which go on training on their uplinks: they restore the
// checkpoint and take the outer weights from the reducer. A replica that
// joins a pipeline going on would still fetch from a holder.
TEST(StateSourcesTest, APipelineFormedAnewTakesNoHolder) {
  const v1::Plan before = PlanOf({{"a"}, {"b"}, {"c"}});  // pipeline 0 alone
  v1::Plan next = PlanOf({{"a", "x"}, {"b", "y"}, {"c", "z"}});
  next.set_epoch(3);
  for (auto& s : *next.mutable_stages()) s.mutable_replicas(0)->set_pipeline(1);
  v1::PipelineInfo* p0 = next.add_pipeline_info();
  p0->set_pipeline(0);
  p0->set_formed_epoch(1);
  v1::PipelineInfo* p1 = next.add_pipeline_info();
  p1->set_pipeline(1);
  p1->set_formed_epoch(3);
  AssignStateSources(&before, &next);
  for (const auto& s : next.stages()) EXPECT_FALSE(s.has_state_source()) << s.stage();
  // The same plan without the pipelines' entries (no outer sync): holders.
  next.clear_pipeline_info();
  AssignStateSources(&before, &next);
  EXPECT_EQ(next.stages(1).state_source().worker_id(), "b");
  EXPECT_EQ(next.stages(1).state_source().for_workers(0), "y");
}

// A worker whose stage changed (other layers, or another stage count) has
// rebuilt it: it is no source; a replaced stage with no holder left takes
// the coordinator's checkpoints; the first plan has no holders.
TEST(StateSourcesTest, OnlyAWorkerThatKeepsTheVerySameStageIsASource) {
  const v1::Plan before = PlanOf({{"a"}, {"b"}, {"d"}});
  v1::Plan moved = PlanOf({{"a"}, {"e", "d"}});  // 2 stages now: nobody keeps stage 1
  AssignStateSources(&before, &moved);
  EXPECT_FALSE(moved.stages(1).has_state_source());
  v1::Plan replaced = PlanOf({{"a"}, {"e"}, {"d"}});
  AssignStateSources(&before, &replaced);
  EXPECT_FALSE(replaced.stages(1).has_state_source());
  v1::Plan first = PlanOf({{"a"}, {"b", "c"}, {"d"}});
  AssignStateSources(nullptr, &first);
  for (const auto& s : first.stages()) EXPECT_FALSE(s.has_state_source());
  // A source from an older plan is cleared.
  v1::Plan same = before;
  same.mutable_stages(1)->mutable_state_source()->set_worker_id("x");
  AssignStateSources(&before, &same);
  EXPECT_FALSE(same.stages(1).has_state_source());
}

}  // namespace
}  // namespace geotrain
