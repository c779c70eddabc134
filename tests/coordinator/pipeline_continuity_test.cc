// Which pipelines a new plan continues, and their data: a pipeline whose
// chain a re-plan leaves alone keeps its entry (formed epoch, start step,
// lane); the others are formed anew on free lanes past every index drawn;
// and across a run of re-plans (a lost worker replaced, a pipeline
// dissolved, one formed from standbys, one more than there are lanes) no
// index is ever drawn by two microbatches.
#include "coordinator/pipeline_continuity.h"

#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "common/plan_util.h"
#include "coordinator/pipeline_repair.h"

namespace geotrain {
namespace {

constexpr int kMicrobatches = 4;

// R pipelines of two stages: stages[0][r] on stage 0, stages[1][r] on 1,
// each pipeline's link from stage 0 to stage 1 dialled by the upstream end.
v1::Plan Pipelines(uint64_t epoch, int start_step,
                   const std::vector<std::vector<std::string>>& stages) {
  v1::Plan plan;
  plan.set_epoch(epoch);
  plan.set_start_step(start_step);
  const int pipelines = static_cast<int>(stages[0].size());
  if (pipelines > 1) plan.set_pipelines(pipelines);
  for (int k = 0; k < 2; ++k) {
    v1::StageAssignment* stage = plan.add_stages();
    stage->set_stage(k);
    stage->set_layer_begin(2 * k);
    stage->set_layer_end(2 * k + 2);
    std::vector<StageWorker> workers;
    for (int r = 0; r < pipelines; ++r) workers.push_back({stages[k][r], stages[k][r] + ":1", r});
    SetStageWorkers(stage, workers);
  }
  for (int r = 0; r < pipelines; ++r) {
    v1::PlannedLink* link = plan.add_links();
    link->set_upstream_worker(stages[0][r]);
    link->set_downstream_worker(stages[1][r]);
    link->set_dialer(v1::LINK_DIALER_UPSTREAM);
  }
  return plan;
}

// What the old plan's pipelines reached, and a window of one step.
PipelineDataInput Reached(std::map<int, int> steps) {
  PipelineDataInput input;
  input.microbatches = kMicrobatches;
  input.in_flight_steps = 1;
  input.first_stage_step = [steps](int pipeline) {
    auto it = steps.find(pipeline);
    return it == steps.end() ? 0 : it->second;
  };
  return input;
}

// The next plan as the coordinator publishes it: the high-water mark, then
// the pipelines' entries.
std::set<int> Publish(const v1::Plan* old, const PipelineDataInput& input, v1::Plan* next) {
  if (old != nullptr) next->set_data_base(static_cast<uint64_t>(DataHighWater(*old, input)));
  return AssignPipelineInfo(old, input, next);
}

TEST(PipelineContinuityTest, AFirstPlanGivesEachPipelineALane) {
  v1::Plan plan = Pipelines(1, 0, {{"a0", "b0"}, {"a1", "b1"}});
  EXPECT_TRUE(Publish(nullptr, Reached({}), &plan).empty());
  ASSERT_EQ(plan.pipeline_info_size(), 2);
  for (int r = 0; r < 2; ++r) {
    const v1::PipelineInfo& info = plan.pipeline_info(r);
    EXPECT_EQ(info.pipeline(), r);
    EXPECT_EQ(info.formed_epoch(), 1u);
    EXPECT_EQ(info.start_step(), 0);
    EXPECT_EQ(info.data_base(), 0u);
    EXPECT_EQ(info.data_stride(), 2);
    EXPECT_EQ(info.data_lane(), r);
  }
  // One pipeline that continues nothing: no entries (as before pipelines).
  v1::Plan one = Pipelines(1, 0, {{"a0"}, {"a1"}});
  Publish(nullptr, Reached({}), &one);
  EXPECT_EQ(one.pipeline_info_size(), 0);
}

TEST(PipelineContinuityTest, OnlyAnUnchangedChainContinues) {
  v1::Plan old = Pipelines(1, 0, {{"a0", "b0"}, {"a1", "b1"}});
  Publish(nullptr, Reached({}), &old);
  // b1 replaced by a standby: pipeline 0 continues, pipeline 1 does not.
  v1::Plan next = Pipelines(2, 10, {{"a0", "b0"}, {"a1", "s"}});
  EXPECT_EQ(ContinuingPipelines(old, next), std::set<int>{0});
  // Other cuts, another window, another dialer: nothing continues.
  v1::Plan cut = next;
  cut.mutable_stages(0)->set_layer_end(1);
  cut.mutable_stages(1)->set_layer_begin(1);
  EXPECT_TRUE(ContinuingPipelines(old, cut).empty());
  v1::Plan window = next;
  window.set_in_flight(7);
  EXPECT_TRUE(ContinuingPipelines(old, window).empty());
  v1::Plan relayed = next;
  relayed.mutable_links(0)->set_dialer(v1::LINK_DIALER_RELAY);
  relayed.mutable_links(0)->set_relay_worker("r");
  EXPECT_TRUE(ContinuingPipelines(old, relayed).empty());
  // A plan without entries continues nothing.
  EXPECT_TRUE(ContinuingPipelines(Pipelines(1, 0, {{"a0", "b0"}, {"a1", "b1"}}), next).empty());
}

TEST(PipelineContinuityTest, APipelineFormedAnewStartsWithTheFurthestOnAFreeLane) {
  v1::Plan old = Pipelines(1, 0, {{"a0", "b0"}, {"a1", "b1"}});
  Publish(nullptr, Reached({}), &old);
  v1::Plan next = Pipelines(2, 10, {{"a0", "b0"}, {"a1", "s"}});
  // Pipeline 0's stage 0 reached step 30, pipeline 1's step 12.
  EXPECT_EQ(Publish(&old, Reached({{0, 30}, {1, 12}}), &next), std::set<int>{0});
  ASSERT_EQ(next.pipeline_info_size(), 2);
  EXPECT_EQ(next.pipeline_info(0).SerializeAsString(), old.pipeline_info(0).SerializeAsString());
  const v1::PipelineInfo& formed = next.pipeline_info(1);
  EXPECT_EQ(formed.formed_epoch(), 2u);
  EXPECT_EQ(formed.start_step(), 30);
  EXPECT_EQ(formed.data_stride(), 2);
  EXPECT_EQ(formed.data_lane(), 1);
  // Past what pipeline 0 drew (31 steps and a window of 2 x 4 indices).
  EXPECT_GE(formed.data_base(), uint64_t{(30 + 1 + 1) * 2 * kMicrobatches});
  EXPECT_EQ(formed.data_base() % (2 * kMicrobatches), 0u);
}

// Every index drawn across a run of re-plans, by (pipeline's formed
// epoch, lane, step, microbatch): no index twice.
class DrawLedger {
 public:
  // Pipeline r of `plan` draws the steps [from, to) of its own.
  void Draw(const v1::Plan& plan, int r, int from, int to) {
    const v1::PipelineInfo* info = PipelineInfoOf(plan, r);
    ASSERT_NE(info, nullptr);
    // Split (OuterOptimizer.split_batch): its share of a step, in blocks
    // of the job's M.
    const int m = info->microbatches() > 0 ? info->microbatches() : kMicrobatches;
    const uint64_t block = info->data_block() > 0
                               ? uint64_t(info->data_block())
                               : uint64_t(info->data_stride()) * kMicrobatches;
    for (int s = std::max(from, info->start_step()); s < to; ++s) {
      for (int j = 0; j < m; ++j) {
        const uint64_t index = info->data_base() + uint64_t(s - info->start_step()) * block +
                               uint64_t(j) * info->data_stride() + info->data_lane();
        const auto who = std::make_tuple(info->formed_epoch(), info->data_lane(), s, j);
        auto [it, inserted] = drawn_.emplace(index, who);
        EXPECT_TRUE(inserted || it->second == who)
            << "index " << index << " drawn twice (epoch " << plan.epoch() << ", pipeline " << r
            << ", step " << s << ")";
      }
    }
  }

 private:
  std::map<uint64_t, std::tuple<uint64_t, int, int, int>> drawn_;
};

// Pipelines through a run of re-plans; `split`: they share the job's
// batch (OuterOptimizer.split_batch).
void DrawAcrossReplans(bool split) {
  DrawLedger ledger;
  auto Reached = [split](std::map<int, int> steps) {
    PipelineDataInput input = ::geotrain::Reached(std::move(steps));
    input.split_batch = split;
    return input;
  };
  // Epoch 1: two pipelines; pipeline 0 reaches step 30, pipeline 1 step 12
  // (each draws a window more).
  v1::Plan p1 = Pipelines(1, 0, {{"a0", "b0"}, {"a1", "b1"}});
  Publish(nullptr, Reached({}), &p1);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(p1.pipeline_info(r).microbatches(), split ? kMicrobatches / 2 : 0);
    EXPECT_EQ(p1.pipeline_info(r).data_block(), split ? kMicrobatches : 0);
  }
  ledger.Draw(p1, 0, 0, 32);
  ledger.Draw(p1, 1, 0, 14);
  // Epoch 2: b1 is replaced; pipeline 1 is formed anew at step 30.
  v1::Plan p2 = Pipelines(2, 12, {{"a0", "b0"}, {"a1", "s"}});
  ASSERT_EQ(Publish(&p1, Reached({{0, 30}, {1, 12}}), &p2), std::set<int>{0});
  ledger.Draw(p2, 0, 30, 52);
  ledger.Draw(p2, 1, 30, 45);
  // Epoch 3: s is lost with no standby: pipeline 1 is dissolved, pipeline 0
  // goes on alone on its lane.
  v1::Plan p3 = Pipelines(3, 43, {{"a0"}, {"a1"}});
  ASSERT_EQ(Publish(&p2, Reached({{0, 50}, {1, 43}}), &p3), std::set<int>{0});
  ASSERT_EQ(p3.pipeline_info_size(), 1);
  EXPECT_EQ(p3.pipeline_info(0).formed_epoch(), 1u);
  ledger.Draw(p3, 0, 50, 70);
  // Epoch 4: standbys, one per stage, form pipeline 1 again.
  v1::Plan p4 = Pipelines(4, 68, {{"a0", "b0"}, {"a1", "t"}});
  ASSERT_EQ(Publish(&p3, Reached({{0, 68}}), &p4), std::set<int>{0});
  EXPECT_EQ(p4.pipeline_info(1).data_lane(), 1);
  EXPECT_EQ(p4.pipeline_info(1).start_step(), 68);
  ledger.Draw(p4, 0, 68, 90);
  ledger.Draw(p4, 1, 68, 85);
  // Epoch 5: a third pipeline: more pipelines than lanes, so every one is
  // formed anew with a stride of three.
  v1::Plan p5 = Pipelines(5, 83, {{"a0", "b0", "c0"}, {"a1", "t", "c1"}});
  EXPECT_TRUE(Publish(&p4, Reached({{0, 88}, {1, 83}}), &p5).empty());
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(p5.pipeline_info(r).formed_epoch(), 5u);
    EXPECT_EQ(p5.pipeline_info(r).data_stride(), 3);
    EXPECT_EQ(p5.pipeline_info(r).start_step(), 83);
    // Split, 4 microbatches among 3 lanes: 2, 1 and 1.
    EXPECT_EQ(p5.pipeline_info(r).microbatches(), split ? (r == 0 ? 2 : 1) : 0);
    ledger.Draw(p5, r, 83, 120);
  }
}

TEST(PipelineContinuityTest, NoIndexIsDrawnTwiceAcrossReplans) { DrawAcrossReplans(false); }

TEST(PipelineContinuityTest, NoIndexIsDrawnTwiceAcrossReplansWhenPipelinesSplitTheBatch) {
  DrawAcrossReplans(true);
}

// Split, a step's indices are the job's M whatever R: a pipeline formed
// anew starts on a block of M past the high-water mark, which counts M a
// step, not R x M.
TEST(PipelineContinuityTest, SplitPipelinesSpanTheJobsBatchAStep) {
  PipelineDataInput none = Reached({});
  none.split_batch = true;
  v1::Plan old = Pipelines(1, 0, {{"a0", "b0"}, {"a1", "b1"}});
  Publish(nullptr, none, &old);
  PipelineDataInput reached = Reached({{0, 30}, {1, 12}});
  reached.split_batch = true;
  EXPECT_EQ(DataHighWater(old, reached), int64_t{30 + 1 + 1} * kMicrobatches);
  v1::Plan next = Pipelines(2, 10, {{"a0", "b0"}, {"a1", "s"}});
  Publish(&old, reached, &next);
  const v1::PipelineInfo& formed = next.pipeline_info(1);
  EXPECT_EQ(formed.data_base(), uint64_t{32 * kMicrobatches});
  EXPECT_EQ(formed.microbatches(), kMicrobatches / 2);
  EXPECT_EQ(formed.data_block(), kMicrobatches);
}

TEST(PipelineContinuityTest, TheHighWaterMarkOfAPlanWithoutEntries) {
  // R = 2 from step 10 at base 100; pipelines reached steps 20 and 25.
  v1::Plan old = Pipelines(3, 10, {{"a0", "b0"}, {"a1", "b1"}});
  old.set_data_base(100);
  EXPECT_EQ(DataHighWater(old, Reached({{0, 20}, {1, 25}})),
            100 + int64_t{25 + 1 + 1 - 10} * 2 * kMicrobatches);
}

// Issue 35's rollback: the job goes on drawing where the plan then in
// force had got to after the step it rolls back to. A first plan's
// pipelines, formed together and rolled back to step 0, draw exactly what
// they drew the first time; rolled back to step 7, what came after it.
TEST(PipelineContinuityTest, ARollbackDrawsAgainWhatCameAfterItsStep) {
  v1::Plan first = Pipelines(1, 0, {{"a0", "b0"}, {"a1", "b1"}});
  Publish(nullptr, Reached({}), &first);
  EXPECT_EQ(DataIndexAfterStep(first, 0, kMicrobatches), 0);
  EXPECT_EQ(DataIndexAfterStep(first, 7, kMicrobatches), int64_t{7} * 2 * kMicrobatches);
  // The rollback's plan, formed anew from that index, has the same lanes
  // and base as the first plan: the same indices step by step.
  v1::Plan again = Pipelines(5, 0, {{"a0", "b0"}, {"a1", "s"}});
  again.set_data_base(static_cast<uint64_t>(DataIndexAfterStep(first, 0, kMicrobatches)));
  AssignPipelineInfo(nullptr, Reached({}), &again);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(again.pipeline_info(r).data_base(), first.pipeline_info(r).data_base());
    EXPECT_EQ(again.pipeline_info(r).data_lane(), first.pipeline_info(r).data_lane());
    EXPECT_EQ(again.pipeline_info(r).data_stride(), first.pipeline_info(r).data_stride());
  }
  // Pipelines formed in different plans: past the furthest.
  v1::Plan later = Pipelines(2, 10, {{"a0", "b0"}, {"a1", "s"}});
  Publish(&first, Reached({{0, 12}, {1, 12}}), &later);
  const v1::PipelineInfo& formed = later.pipeline_info(1);  // at step 12, past 112
  ASSERT_EQ(formed.start_step(), 12);
  EXPECT_EQ(DataIndexAfterStep(later, 15, kMicrobatches),
            std::max<int64_t>(15 * 2 * kMicrobatches,
                              static_cast<int64_t>(formed.data_base()) +
                                  int64_t{15 - 12} * 2 * kMicrobatches));
  // Without entries: from its base.
  v1::Plan one = Pipelines(3, 10, {{"a0"}, {"b0"}});
  one.set_data_base(100);
  EXPECT_EQ(DataIndexAfterStep(one, 14, kMicrobatches), 100 + int64_t{4} * kMicrobatches);
}

}  // namespace
}  // namespace geotrain
