#include "coordinator/loss_jump_watch.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

// Three pipelines with about the same loss: none is a suspect; one whose
// loss leaves the others' median is, until it comes back.
TEST(LossJumpWatchTest, APipelineFarAboveTheOthersIsASuspectUntilItReturns) {
  LossJumpWatch watch;
  for (int step = 0; step < 30; ++step) {
    for (int r = 0; r < 3; ++r) {
      EXPECT_FALSE(watch.Record(r, 2.0 - 0.01 * step + 0.05 * r).has_value());
    }
  }
  std::optional<std::string> change = watch.Record(2, 4.5);
  ASSERT_TRUE(change.has_value());
  EXPECT_NE(change->find("pipeline 2's loss 4.5"), std::string::npos) << *change;
  EXPECT_FALSE(watch.SuspicionOf(2).empty());
  EXPECT_TRUE(watch.SuspicionOf(0).empty());
  EXPECT_FALSE(watch.Record(2, 5.0).has_value());  // still: no new change
  change = watch.Record(2, 1.8);
  ASSERT_TRUE(change.has_value());
  EXPECT_EQ(*change, "");
  EXPECT_TRUE(watch.SuspicionOf(2).empty());
}

// With two pipelines nothing says which is off against the other; a jump
// against a pipeline's own recent losses still counts.
TEST(LossJumpWatchTest, AJumpAgainstItsOwnHistoryCountsWithTwoPipelines) {
  LossJumpWatch watch;
  for (int step = 0; step < 30; ++step) {
    EXPECT_FALSE(watch.Record(0, 1.0).has_value());
    EXPECT_FALSE(watch.Record(1, 1.5).has_value());
  }
  EXPECT_FALSE(watch.Record(1, 2.9).has_value());  // under 2x its largest
  std::optional<std::string> change = watch.Record(0, 2.5);
  ASSERT_TRUE(change.has_value());
  EXPECT_NE(change->find("jumped"), std::string::npos) << *change;
  // Not a NaN or an infinity: those are refused before they get here.
  EXPECT_FALSE(watch.Record(1, std::nan("")).has_value());
}

// A young pipeline has no history to jump against.
TEST(LossJumpWatchTest, NoJudgmentOnAShortHistory) {
  LossJumpWatch watch;
  EXPECT_FALSE(watch.Record(0, 1.0).has_value());
  EXPECT_FALSE(watch.Record(0, 9.0).has_value());
  EXPECT_TRUE(watch.SuspicionOf(0).empty());
}

}  // namespace
}  // namespace geotrain
