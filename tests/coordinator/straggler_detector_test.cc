#include "coordinator/straggler_detector.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "common/clock.h"

namespace geotrain {
namespace {

// Three stages of two layers each; `seconds` per stage, one worker each.
std::vector<StageTimings> Pipeline(const std::vector<double>& seconds) {
  std::vector<StageTimings> stages;
  for (size_t k = 0; k < seconds.size(); ++k) {
    StageTimings& s = stages.emplace_back();
    s.layer_begin = static_cast<int>(2 * k);
    s.layer_end = static_cast<int>(2 * k + 2);
    s.workers = {{"w" + std::to_string(k), seconds[k]}};
  }
  return stages;
}

TEST(StragglerDetectorTest, ASlowedStageIsReportedAfterThePatienceAndOnlyThen) {
  FakeClock clock(0);
  StragglerDetector detector;
  // Its pace on these layers: 10 ms, like the others.
  EXPECT_TRUE(detector.Check(Pipeline({0.010, 0.010, 0.010}), clock.NowMs()).empty());
  EXPECT_DOUBLE_EQ(detector.BestPaceOf("w1"), 0.010);
  // w1 slows to 50 ms: 5x the others, 5x its own best; not yet for 5 s.
  EXPECT_TRUE(detector.Check(Pipeline({0.010, 0.050, 0.010}), clock.NowMs()).empty());
  clock.AdvanceMs(4999);
  EXPECT_TRUE(detector.Check(Pipeline({0.010, 0.050, 0.010}), clock.NowMs()).empty());
  clock.AdvanceMs(1);
  std::vector<StragglerVerdict> slow = detector.Check(Pipeline({0.010, 0.050, 0.010}), clock.NowMs());
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0].worker_id, "w1");
  EXPECT_FALSE(slow[0].demote);
  EXPECT_EQ(slow[0].reason,
            "stage 1 takes 50.0 ms per microbatch, 5.0x the slowest other stage and 5.0x its "
            "own best, for 5 s");
  // Reported again only after another patience period.
  clock.AdvanceMs(1000);
  EXPECT_TRUE(detector.Check(Pipeline({0.010, 0.050, 0.010}), clock.NowMs()).empty());
}

TEST(StragglerDetectorTest, AnEndlessPatienceNeverReports) {
  // What the coordinator's --straggler_patience=inf gives.
  StragglerOptions options;
  options.patience_ms = std::numeric_limits<int64_t>::max();
  StragglerDetector detector(options);
  FakeClock clock(0);
  EXPECT_TRUE(detector.Check(Pipeline({0.010, 0.010, 0.010}), clock.NowMs()).empty());
  for (int i = 0; i < 100; ++i) {
    clock.AdvanceMs(24 * 3600 * 1000);
    EXPECT_TRUE(detector.Check(Pipeline({0.010, 0.500, 0.010}), clock.NowMs()).empty());
  }
}

TEST(StragglerDetectorTest, AStageSlowFromTheStartOrRecoveringIsNoStraggler) {
  FakeClock clock(0);
  StragglerDetector detector;
  // Given too much work from the start: 5x the others but at its own best.
  for (int i = 0; i < 10; ++i) {
    EXPECT_TRUE(detector.Check(Pipeline({0.010, 0.050, 0.010}), clock.NowMs()).empty());
    clock.AdvanceMs(1000);
  }
  // A stage that slows, then recovers within the patience, starts over.
  StragglerDetector other;
  other.Check(Pipeline({0.010, 0.010, 0.010}), clock.NowMs());
  other.Check(Pipeline({0.010, 0.050, 0.010}), clock.NowMs());
  clock.AdvanceMs(4000);
  other.Check(Pipeline({0.010, 0.012, 0.010}), clock.NowMs());
  clock.AdvanceMs(1000);
  EXPECT_TRUE(other.Check(Pipeline({0.010, 0.050, 0.010}), clock.NowMs()).empty());
  // And a new plan restarts the patience too.
  clock.AdvanceMs(4000);
  other.ResetPatience();
  clock.AdvanceMs(1000);
  EXPECT_TRUE(other.Check(Pipeline({0.010, 0.050, 0.010}), clock.NowMs()).empty());
}

TEST(StragglerDetectorTest, ASlowReplicaIsDemotedAndMissingFiguresWait) {
  FakeClock clock(0);
  StragglerDetector detector;
  std::vector<StageTimings> stages = Pipeline({0.010, 0.010, 0.010});
  stages[1].workers.push_back({"r1", 0.040});  // 4x its fastest sibling
  EXPECT_TRUE(detector.Check(stages, clock.NowMs()).empty());
  clock.AdvanceMs(5000);
  std::vector<StragglerVerdict> slow = detector.Check(stages, clock.NowMs());
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0].worker_id, "r1");
  EXPECT_TRUE(slow[0].demote);
  EXPECT_NE(slow[0].reason.find("4.0x its fastest replica"), std::string::npos);
  // A stage with no figure yet: nothing is judged.
  stages[2].workers.clear();
  clock.AdvanceMs(10000);
  EXPECT_TRUE(detector.Check(stages, clock.NowMs()).empty());
}

TEST(StragglerDetectorTest, OptionsSetTheThresholds) {
  FakeClock clock(0);
  StragglerOptions options;
  options.stage_factor = 1.5;
  options.slowdown_factor = 1.2;
  options.patience_ms = 0;
  StragglerDetector detector(options);
  detector.Check(Pipeline({0.010, 0.010}), clock.NowMs());
  std::vector<StragglerVerdict> slow = detector.Check(Pipeline({0.010, 0.020}), clock.NowMs());
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0].worker_id, "w1");
}

}  // namespace
}  // namespace geotrain
