#include "common/spot_check_draw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace geotrain {
namespace {

std::string CountingKey() {
  std::string key;
  for (int i = 0; i < 32; ++i) key.push_back(static_cast<char>(i));
  return key;
}

// The layout is the documented one: Python's hmac over the same bytes
// (key 00..1f, epoch 3, microbatch 1234, stage 2) gives 0.9805594306201294.
TEST(SpotCheckDrawTest, MatchesTheDocumentedHmac) {
  auto draw = SpotCheckDraw::Create(CountingKey(), 0.01);
  ASSERT_TRUE(draw.ok()) << draw.status();
  EXPECT_DOUBLE_EQ(draw->Draw(3, 1234, 2), 0.9805594306201294);
  EXPECT_FALSE(draw->Chosen(3, 1234, 2));
}

// About f of the computations are chosen: within 4 standard deviations
// over 200,000 draws, for each stage.
TEST(SpotCheckDrawTest, ChoosesAboutTheFraction) {
  auto draw = SpotCheckDraw::Create(CountingKey(), 0.01);
  ASSERT_TRUE(draw.ok());
  constexpr int kDraws = 200000;
  const double sigma = std::sqrt(kDraws * 0.01 * 0.99);
  for (int stage = 0; stage < 3; ++stage) {
    int chosen = 0;
    for (uint64_t m = 0; m < kDraws; ++m) chosen += draw->Chosen(7, m, stage);
    EXPECT_NEAR(chosen, kDraws * 0.01, 4 * sigma) << "stage " << stage;
  }
}

// Another key chooses other microbatches: without the key, which ones are
// checked cannot be told. The two sets overlap about as independent draws
// do (f^2 of them).
TEST(SpotCheckDrawTest, AnotherKeyChoosesOthers) {
  std::string other_key = CountingKey();
  other_key[0] ^= 1;
  auto a = SpotCheckDraw::Create(CountingKey(), 0.1);
  auto b = SpotCheckDraw::Create(other_key, 0.1);
  ASSERT_TRUE(a.ok() && b.ok());
  int both = 0;
  int only_a = 0;
  for (uint64_t m = 0; m < 20000; ++m) {
    both += a->Chosen(1, m, 0) && b->Chosen(1, m, 0);
    only_a += a->Chosen(1, m, 0) && !b->Chosen(1, m, 0);
  }
  EXPECT_NEAR(both, 200, 60);
  EXPECT_NEAR(only_a, 1800, 160);
  // The epoch and the stage are part of the draw too.
  int differ_epoch = 0;
  int differ_stage = 0;
  for (uint64_t m = 0; m < 1000; ++m) {
    differ_epoch += a->Draw(1, m, 0) != a->Draw(2, m, 0);
    differ_stage += a->Draw(1, m, 0) != a->Draw(1, m, 1);
  }
  EXPECT_EQ(differ_epoch, 1000);
  EXPECT_EQ(differ_stage, 1000);
}

TEST(SpotCheckDrawTest, NoneAndAll) {
  auto none = SpotCheckDraw::Create(CountingKey(), 0);
  auto all = SpotCheckDraw::Create(CountingKey(), 1);
  ASSERT_TRUE(none.ok() && all.ok());
  for (uint64_t m = 0; m < 1000; ++m) {
    EXPECT_FALSE(none->Chosen(0, m, 0));
    EXPECT_TRUE(all->Chosen(0, m, 0));
  }
}

TEST(SpotCheckDrawTest, RefusesABadKeyOrFraction) {
  EXPECT_EQ(SpotCheckDraw::Create("short", 0.01).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (double bad : {-0.1, 1.5, std::nan("")}) {
    EXPECT_EQ(SpotCheckDraw::Create(CountingKey(), bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(SpotCheckDrawTest, NewKeysAreRandom) {
  auto a = SpotCheckDraw::NewKey();
  auto b = SpotCheckDraw::NewKey();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), kSpotCheckKeyBytes);
  EXPECT_NE(*a, *b);
}

}  // namespace
}  // namespace geotrain
