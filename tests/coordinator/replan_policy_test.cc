#include "coordinator/replan_policy.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

using Verdict = ReplanDecision::Verdict;

ReplanCandidate Candidate(double current, double best) {
  ReplanCandidate c;
  c.current_s_per_sample = current;
  c.best_s_per_sample = best;
  c.move_bytes = 100 << 20;  // 100 MiB
  c.move_rate_bps = 100e6;   // 8.4 s to move
  return c;
}

TEST(ReplanPolicyTest, ChecksEveryIntervalAndSwitchesOnlyAboveTheThreshold) {
  ReplanPolicy policy;  // 20%, 10 min, 2 min, every 30 s
  int64_t now = 1'000'000;
  ASSERT_TRUE(policy.Due(now));
  ReplanDecision d = policy.Decide(Candidate(0.010, 0.009), now);  // +11%
  EXPECT_EQ(d.verdict, Verdict::kKeep);
  EXPECT_NE(d.reason.find("+11%"), std::string::npos) << d.reason;
  EXPECT_NE(d.reason.find("threshold"), std::string::npos) << d.reason;
  EXPECT_FALSE(policy.Due(now + 29'000));
  EXPECT_TRUE(policy.Due(now + 30'000));
  d = policy.Decide(Candidate(0.010, 0.005), now + 30'000);  // +100%
  EXPECT_EQ(d.verdict, Verdict::kSwitch) << d.reason;
  EXPECT_NE(d.reason.find("10.000 ms/sample"), std::string::npos) << d.reason;
  EXPECT_NE(d.reason.find("paid back"), std::string::npos) << d.reason;
}

TEST(ReplanPolicyTest, AtMostOneVoluntaryReplanPerInterval) {
  ReplanPolicy policy;
  int64_t now = 1'000'000;
  ASSERT_EQ(policy.Decide(Candidate(0.010, 0.005), now).verdict, Verdict::kSwitch);
  policy.Switched(now);
  now += 60'000;
  ReplanDecision d = policy.Decide(Candidate(0.010, 0.005), now);
  EXPECT_EQ(d.verdict, Verdict::kDefer);
  EXPECT_NE(d.reason.find("60 s ago"), std::string::npos) << d.reason;
  now += 60'000;
  EXPECT_EQ(policy.Decide(Candidate(0.010, 0.005), now).verdict, Verdict::kSwitch);
}

TEST(ReplanPolicyTest, AMoveThatDoesNotPayBackWithinTheHorizonIsNotMade) {
  ReplanPolicy policy;
  // 25% faster, but 10 GiB over 10 Mb/s (2.4 h) never pays back in 10 min.
  ReplanCandidate c = Candidate(0.010, 0.008);
  c.move_bytes = 10.0 * (1ull << 30);
  c.move_rate_bps = 10e6;
  ReplanDecision d = policy.Decide(c, 0);
  EXPECT_EQ(d.verdict, Verdict::kKeep);
  EXPECT_NE(d.reason.find("horizon"), std::string::npos) << d.reason;
  // Unknown rate: not moved either.
  c.move_rate_bps = 0;
  c.move_bytes = 1;
  EXPECT_EQ(policy.Decide(c, 60'000).verdict, Verdict::kKeep);
  // Nothing to move (only the order changes): the gain alone decides.
  c.move_bytes = 0;
  EXPECT_EQ(policy.Decide(c, 120'000).verdict, Verdict::kSwitch);
}

TEST(ReplanPolicyTest, AMoveWaitsForFreshCheckpointsOfTheMovedLayers) {
  ReplanPolicy policy;
  ReplanCandidate c = Candidate(0.010, 0.005);
  c.state_fresh = false;
  ReplanDecision d = policy.Decide(c, 0);
  EXPECT_EQ(d.verdict, Verdict::kDefer);
  EXPECT_NE(d.reason.find("checkpoints"), std::string::npos);
  // Checked again a second later, not a whole interval.
  EXPECT_FALSE(policy.Due(999));
  EXPECT_TRUE(policy.Due(1000));
  c.state_fresh = true;
  EXPECT_EQ(policy.Decide(c, 1000).verdict, Verdict::kSwitch);
}

TEST(ReplanPolicyTest, MissingPredictionsKeepThePlan) {
  ReplanPolicy policy;
  EXPECT_EQ(policy.Decide(Candidate(0, 0.005), 0).verdict, Verdict::kKeep);
  EXPECT_EQ(policy.Decide(Candidate(0.01, 0), 30'000).verdict, Verdict::kKeep);
}

}  // namespace
}  // namespace geotrain
