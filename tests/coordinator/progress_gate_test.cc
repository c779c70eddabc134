#include "coordinator/progress_gate.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

ProgressGate::Step Step(int step) { return {step, 2.0, 8}; }

std::vector<int> Steps(const std::vector<ProgressGate::Step>& steps) {
  std::vector<int> out;
  for (const ProgressGate::Step& s : steps) out.push_back(s.step);
  return out;
}

class ProgressGateTest : public testing::Test {
 protected:
  ProgressGateTest() : gate_(ProgressGateOptions{/*total_steps=*/1000, /*max_lead_steps=*/8}) {
    gate_.StartEpoch(1, 0, {{"first", 0}, {"first-replica", 0}}, {{"last", 0}});
  }
  ProgressGate gate_;
};

TEST_F(ProgressGateTest, AStepCommitsOnceBothEndsHaveFinishedIt) {
  auto claimed = gate_.Claim("last", 1, Step(1));
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  EXPECT_TRUE(claimed->empty());
  ASSERT_TRUE(gate_.Claim("last", 1, Step(2)).ok());
  EXPECT_EQ(Steps(gate_.FirstStageFinished("first", 1, 1)), std::vector<int>{1});
  EXPECT_EQ(gate_.committed_step(), 1);
  EXPECT_EQ(gate_.claimed_step(), 2);
  // A replica of stage 0 may vouch too.
  EXPECT_EQ(Steps(gate_.FirstStageFinished("first-replica", 1, 5)), std::vector<int>{2});
  // A claim stage 0 has already passed commits at once; a lost report's
  // step (3) is passed over.
  EXPECT_EQ(Steps(*gate_.Claim("last", 1, Step(4))), std::vector<int>{4});
  EXPECT_EQ(gate_.committed_step(), 4);
}

TEST_F(ProgressGateTest, NoOneElseAndNoOtherEpochSpeaksForTheEnds) {
  EXPECT_EQ(gate_.Claim("first", 1, Step(1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gate_.Claim("last", 2, Step(1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(gate_.Claim("last", 1, Step(1)).ok());
  EXPECT_TRUE(gate_.FirstStageFinished("last", 1, 1).empty());
  EXPECT_TRUE(gate_.FirstStageFinished("stranger", 1, 1).empty());
  EXPECT_TRUE(gate_.FirstStageFinished("first", 0, 1).empty());
  EXPECT_EQ(gate_.committed_step(), 0);
}

TEST_F(ProgressGateTest, AClaimFarAheadOfStageZeroIsAJump) {
  ASSERT_TRUE(gate_.Claim("last", 1, Step(8)).ok());
  EXPECT_EQ(gate_.Claim("last", 1, Step(9)).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(gate_.Claim("last", 1, Step(1000)).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(gate_.Claim("last", 1, Step(1001)).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(gate_.Claim("last", 1, Step(8)).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "a step claimed twice";
  gate_.FirstStageFinished("first", 1, 8);
  EXPECT_EQ(gate_.committed_step(), 8);
  EXPECT_TRUE(gate_.Claim("last", 1, Step(16)).ok()) << "the window moves with stage 0";
}

TEST_F(ProgressGateTest, ANewEpochDropsHeldClaimsAndKeepsWhatCommitted) {
  ASSERT_TRUE(gate_.Claim("last", 1, Step(1)).ok());
  ASSERT_TRUE(gate_.Claim("last", 1, Step(2)).ok());
  gate_.FirstStageFinished("first", 1, 1);
  gate_.StartEpoch(2, 1, {{"first", 0}}, {{"new-last", 0}});
  EXPECT_EQ(gate_.committed_step(), 1);
  EXPECT_EQ(gate_.claimed_step(), 1);
  EXPECT_TRUE(gate_.FirstStageFinished("first", 2, 2).empty()) << "step 2's claim was dropped";
  EXPECT_EQ(Steps(*gate_.Claim("new-last", 2, Step(2))), std::vector<int>{2});
}

TEST_F(ProgressGateTest, OneWorkerHoldingBothEndsCommitsAtOnce) {
  gate_.StartEpoch(1, 0, {{"solo", 0}}, {{"solo", 0}});
  EXPECT_EQ(Steps(*gate_.Claim("solo", 1, Step(1))), std::vector<int>{1});
  EXPECT_EQ(gate_.committed_step(), 1);
}

// Two pipelines: each one's claims are corroborated by its own stage 0, and
// a step of the job is the global batch of both.
TEST(ProgressGatePipelinesTest, AStepCommitsOnceEveryPipelineHasFinishedIt) {
  ProgressGate gate(ProgressGateOptions{1000, 8});
  gate.StartEpoch(3, 0, {{"a0", 0}, {"b0", 1}}, {{"a1", 0}, {"b1", 1}});
  ASSERT_TRUE(gate.Claim("a1", 3, {1, 2.0, 8}).ok());
  EXPECT_TRUE(gate.FirstStageFinished("a0", 3, 1).empty());  // pipeline 1 has not
  // Pipeline 1's stage 0 cannot vouch for pipeline 0, nor pipeline 0's for 1.
  ASSERT_TRUE(gate.Claim("b1", 3, {1, 4.0, 24}).ok());
  EXPECT_TRUE(gate.FirstStageFinished("a0", 3, 1).empty());
  std::vector<ProgressGate::Step> committed = gate.FirstStageFinished("b0", 3, 1);
  ASSERT_EQ(committed.size(), 1u);
  EXPECT_EQ(committed[0].step, 1);
  EXPECT_EQ(committed[0].samples, 32);
  EXPECT_DOUBLE_EQ(committed[0].loss, (2.0 * 8 + 4.0 * 24) / 32);  // samples-weighted
  // And each pipeline's own, for the metrics log and the curves.
  EXPECT_EQ(committed[0].pipeline_losses,
            (std::vector<std::pair<int, double>>{{0, 2.0}, {1, 4.0}}));
  // The same step from the other pipeline is not a duplicate; from the
  // same, it is.
  ASSERT_TRUE(gate.Claim("a1", 3, {2, 2.0, 8}).ok());
  EXPECT_EQ(gate.Claim("a1", 3, {2, 2.0, 8}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(gate.Claim("b1", 3, {2, 2.0, 8}).ok());
  // A pipeline that runs ahead waits for the slowest.
  EXPECT_TRUE(gate.FirstStageFinished("a0", 3, 5).empty());
  EXPECT_EQ(gate.slowest_pipeline(), 1);
  EXPECT_EQ(gate.first_stage_step(), 1);
  EXPECT_EQ(gate.first_stage_step(0), 5);
  EXPECT_EQ(Steps(gate.FirstStageFinished("b0", 3, 2)), std::vector<int>{2});
  // Each pipeline's lead is measured against its own stage 0.
  EXPECT_EQ(gate.Claim("b1", 3, {12, 2.0, 8}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(gate.Claim("a1", 3, {12, 2.0, 8}).ok());  // a0 finished step 5
}

// A re-plan that leaves pipeline 0 alone (Plan.pipeline_info): its claims
// and progress go on under the epoch it was formed in, and pipeline 1,
// formed anew at pipeline 0's step, counts the steps before its start as
// done (without samples). An old epoch's report from the pipeline formed
// anew is refused.
TEST(ProgressGatePipelinesTest, AContinuingPipelineKeepsItsProgressThroughARePlan) {
  ProgressGate gate(ProgressGateOptions{1000, 8});
  gate.StartEpoch(1, 0, {{"a0", 0}, {"b0", 1}}, {{"a1", 0}, {"b1", 1}});
  ASSERT_TRUE(gate.Claim("a1", 1, {1, 2.0, 8}).ok());
  ASSERT_TRUE(gate.Claim("b1", 1, {1, 2.0, 8}).ok());
  gate.FirstStageFinished("b0", 1, 1);
  EXPECT_EQ(Steps(gate.FirstStageFinished("a0", 1, 1)), std::vector<int>{1});
  // Pipeline 0 runs on to step 4 (claimed, stage 0 at 3); pipeline 1 dies.
  for (int step = 2; step <= 4; ++step) ASSERT_TRUE(gate.Claim("a1", 1, {step, 2.0, 8}).ok());
  gate.FirstStageFinished("a0", 1, 3);
  // Epoch 2: pipeline 0 formed in epoch 1 goes on; pipeline 1 (b0, c1)
  // is formed anew after step 3.
  gate.StartEpoch(2, gate.committed_step(), {{"a0", 0}, {"b0", 1}}, {{"a1", 0}, {"c1", 1}},
                  {{0, {1, 0}}, {1, {2, 3}}});
  EXPECT_EQ(gate.first_stage_step(0), 3);  // kept
  EXPECT_EQ(gate.first_stage_step(1), 3);  // its start
  // Pipeline 0's reports still carry epoch 1; pipeline 1's carry epoch 2.
  EXPECT_EQ(gate.Claim("a1", 2, {5, 2.0, 8}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gate.Claim("c1", 1, {4, 2.0, 8}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Steps 2 and 3 commit on pipeline 0's claims alone (pipeline 1 starts
  // after them); step 4 waits for pipeline 1.
  std::vector<ProgressGate::Step> committed = gate.FirstStageFinished("a0", 1, 4);
  EXPECT_EQ(Steps(committed), (std::vector<int>{2, 3}));
  EXPECT_EQ(committed[0].samples, 8);
  ASSERT_TRUE(gate.Claim("c1", 2, {4, 3.0, 8}).ok());
  committed = gate.FirstStageFinished("b0", 2, 4);
  EXPECT_EQ(Steps(committed), std::vector<int>{4});
  EXPECT_EQ(committed[0].samples, 16);
  // A pipeline formed anew under the same number with another epoch drops
  // what it held.
  ASSERT_TRUE(gate.Claim("a1", 1, {5, 2.0, 8}).ok());
  gate.StartEpoch(3, gate.committed_step(), {{"a0", 0}, {"b0", 1}}, {{"a1", 0}, {"c1", 1}},
                  {{0, {3, 4}}, {1, {2, 3}}});
  EXPECT_EQ(gate.claimed_step(), 4);
  EXPECT_TRUE(gate.Claim("a1", 3, {5, 2.0, 8}).ok());
}

}  // namespace
}  // namespace geotrain
