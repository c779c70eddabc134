#include "coordinator/membership.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

TEST(MembershipTest, LeaseExpiresWithoutHeartbeats) {
  FakeClock clock(1000);
  Membership membership(&clock, /*lease_ms=*/5000);
  WorkerRecord a = membership.Join("a", "h:1", {});
  WorkerRecord b = membership.Join("b", "h:2", {});
  EXPECT_EQ(a.id, "w0");
  EXPECT_EQ(b.id, "w1");

  clock.AdvanceMs(4000);
  EXPECT_TRUE(membership.Heartbeat(a.id, 123, 7));
  EXPECT_TRUE(membership.ExpireLeases().empty());

  clock.AdvanceMs(1001);  // b silent for 5001 ms; a for 1001 ms
  std::vector<WorkerRecord> expired = membership.ExpireLeases();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].name, "b");
  EXPECT_EQ(membership.LiveWorkers().size(), 1u);
  EXPECT_FALSE(membership.Heartbeat(b.id, 0, 0)) << "a dead worker must join again";

  EXPECT_TRUE(membership.Heartbeat(a.id, 123, 8));
  clock.AdvanceMs(5000);  // exactly the lease: still alive
  EXPECT_TRUE(membership.ExpireLeases().empty());
  clock.AdvanceMs(1);
  EXPECT_EQ(membership.ExpireLeases().size(), 1u);
  EXPECT_TRUE(membership.LiveWorkers().empty());
}

TEST(MembershipTest, HeartbeatRecordsHealth) {
  FakeClock clock;
  Membership membership(&clock, 1000);
  WorkerRecord a = membership.Join("", "h:1", {});
  EXPECT_EQ(a.name, "w0") << "unnamed workers are named by id";
  membership.Heartbeat(a.id, 4096, 12);
  std::vector<WorkerRecord> all = membership.Snapshot();
  EXPECT_EQ(all[0].rss_bytes, 4096u);
  EXPECT_EQ(all[0].step, 12);
}

TEST(MembershipTest, LeaveEndsLeaseAtOnce) {
  FakeClock clock;
  Membership membership(&clock, 1000);
  WorkerRecord a = membership.Join("a", "h:1", {});
  EXPECT_TRUE(membership.Leave(a.id, "left"));
  EXPECT_FALSE(membership.Leave(a.id, "left"));
  EXPECT_TRUE(membership.LiveWorkers().empty());
  EXPECT_FALSE(membership.Heartbeat("w99", 0, 0));
}

}  // namespace
}  // namespace geotrain
