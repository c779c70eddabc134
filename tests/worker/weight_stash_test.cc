#include "worker/weight_stash.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

std::vector<torch::Tensor> Params(float value) {
  return {torch::full({2, 3}, value), torch::full({4}, value)};
}

TEST(WeightStashTest, VersionLivesWhileReferenced) {
  WeightStash stash(Params(0));
  EXPECT_TRUE(stash.Get(0)[0].requires_grad());
  const int64_t a = stash.Acquire();
  const int64_t b = stash.Acquire();
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 0);
  stash.Publish(Params(1));
  EXPECT_EQ(stash.current_version(), 1);
  EXPECT_EQ(stash.versions_alive(), 2u) << "version 0 is still referenced";
  EXPECT_EQ(stash.bytes_alive(), 2u * (6 + 4) * 4);
  ASSERT_TRUE(stash.Release(a).ok());
  EXPECT_TRUE(stash.alive(0));
  ASSERT_TRUE(stash.Release(b).ok());
  EXPECT_FALSE(stash.alive(0)) << "freed with its last reference";
  EXPECT_EQ(stash.versions_alive(), 1u);
  EXPECT_EQ(stash.max_versions_alive(), 2u);
  EXPECT_EQ(stash.references(), 0);
}

TEST(WeightStashTest, UnreferencedOldVersionIsFreedOnPublish) {
  WeightStash stash(Params(0));
  stash.Publish(Params(1));
  stash.Publish(Params(2));
  EXPECT_EQ(stash.versions_alive(), 1u);
  EXPECT_EQ(stash.max_versions_alive(), 1u);
  EXPECT_FLOAT_EQ(stash.Get(2)[1][0].item<float>(), 2.0f);
}

TEST(WeightStashTest, CurrentVersionSurvivesItsLastRelease) {
  WeightStash stash(Params(0));
  const int64_t v = stash.Acquire();
  ASSERT_TRUE(stash.Release(v).ok());
  EXPECT_TRUE(stash.alive(0));
}

TEST(WeightStashTest, DoubleReleaseIsAnError) {
  WeightStash stash(Params(0));
  const int64_t v = stash.Acquire();
  ASSERT_TRUE(stash.Release(v).ok());
  EXPECT_FALSE(stash.Release(v).ok());
  EXPECT_FALSE(stash.Release(42).ok());
}

TEST(WeightStashTest, VersionOfFindsTensorsByIdentity) {
  WeightStash stash(Params(0));
  stash.Acquire();
  stash.Publish(Params(0));  // equal values, different tensors
  EXPECT_EQ(stash.VersionOf(stash.Get(0)[1]), 0);
  EXPECT_EQ(stash.VersionOf(stash.Get(1)[1]), 1);
  EXPECT_EQ(stash.VersionOf(torch::zeros({4})), -1);
}

}  // namespace
}  // namespace geotrain
