#include "worker/audit_weights.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

KeptWeights Version(int layer_begin, int64_t version, uint64_t bytes) {
  KeptWeights w;
  w.layer_begin = layer_begin;
  w.version = version;
  w.digest = "d" + std::to_string(version);
  w.export_layers = [] { return std::vector<v1::LayerCheckpoint>(); };
  w.bytes = bytes;
  return w;
}

// Nothing is kept until a bound is set (a job without spot checks).
TEST(AuditWeightsTest, KeepsNothingWithoutABound) {
  AuditWeights kept;
  EXPECT_FALSE(kept.enabled());
  kept.Keep(Version(0, 1, 10));
  EXPECT_FALSE(kept.Find(1).has_value());
}

// The newest versions within the byte bound, the oldest dropped first; a
// version of another stage starts over.
TEST(AuditWeightsTest, KeepsTheNewestVersionsWithinTheBound) {
  AuditWeights kept(300);
  for (int64_t v = 1; v <= 5; ++v) kept.Keep(Version(2, v, 100));
  EXPECT_EQ(kept.versions(), 3u);
  EXPECT_EQ(kept.bytes(), 300u);
  EXPECT_FALSE(kept.Find(2).has_value());
  ASSERT_TRUE(kept.Find(5).has_value());
  EXPECT_EQ(kept.Find(5)->digest, "d5");
  EXPECT_EQ(*kept.newest(2), 5);
  kept.Keep(Version(4, 9, 100));
  EXPECT_EQ(kept.versions(), 1u);
  EXPECT_FALSE(kept.Find(5).has_value());
  EXPECT_FALSE(kept.newest(2).has_value());
  // Larger than the whole bound: not kept.
  kept.Keep(Version(4, 10, 1000));
  EXPECT_FALSE(kept.Find(10).has_value());
  kept.SetMaxBytes(0);
  EXPECT_EQ(kept.versions(), 0u);
}

// After a rollback a version number recurs with other weights: an audit
// of an output from before it must find the weights that output committed
// to, or none, never the newer ones (their digest would fail an honest
// worker).
TEST(AuditWeightsTest, ARecurringVersionIsFoundByTheDigestCommittedTo) {
  AuditWeights kept(1000);
  kept.Keep(Version(0, 7, 100));  // before the rollback: "d7"
  KeptWeights again = Version(0, 7, 100);
  again.digest = "d7-after-rollback";
  kept.Keep(again);
  EXPECT_EQ(kept.Find(7)->digest, "d7-after-rollback");
  EXPECT_EQ(kept.Find(7, "d7")->digest, "d7");
  EXPECT_EQ(kept.Find(7, "d7-after-rollback")->digest, "d7-after-rollback");
  EXPECT_FALSE(kept.Find(7, "forged").has_value());
}

}  // namespace
}  // namespace geotrain
