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

TEST(MembershipTest, ARetriedJoinReturnsTheMemberItsFirstAttemptCreated) {
  FakeClock clock(1000);
  Membership membership(&clock, /*lease_ms=*/5000);
  bool retried = true;
  WorkerRecord first = membership.Join("a", "h:1", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s1",
                                       &retried);
  EXPECT_FALSE(retried);
  clock.AdvanceMs(3000);
  // The first answer came too late for its caller, which tries again.
  WorkerRecord again = membership.Join("a", "h:1", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s1",
                                       &retried);
  EXPECT_TRUE(retried);
  EXPECT_EQ(again.id, first.id);
  EXPECT_EQ(membership.Snapshot().size(), 1u);
  // The retry renewed the lease.
  clock.AdvanceMs(4000);
  EXPECT_TRUE(membership.ExpireLeases().empty());
  // Another process (session) with the same name and address is another member.
  WorkerRecord other = membership.Join("a", "h:1", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s2",
                                       &retried);
  EXPECT_FALSE(retried);
  EXPECT_NE(other.id, first.id);
  // With a certified id, the session must match too: a restarted process
  // (new session) is re-admitted, not answered as a retry.
  WorkerRecord certified = membership.Join("c", "h:3", {}, "w9", v1::MEMBER_ROLE_WORKER, {},
                                           "s3", &retried);
  EXPECT_FALSE(retried);
  membership.Join("c", "h:3", {}, "w9", v1::MEMBER_ROLE_WORKER, {}, "s3", &retried);
  EXPECT_TRUE(retried);
  membership.Join("c", "h:3", {}, "w9", v1::MEMBER_ROLE_WORKER, {}, "s4", &retried);
  EXPECT_FALSE(retried);
  EXPECT_EQ(certified.id, "w9");
  EXPECT_EQ(membership.Snapshot().size(), 3u);
  // A member whose lease ran out is not a retry's: the join is a new one.
  clock.AdvanceMs(6000);
  membership.ExpireLeases();
  WorkerRecord late = membership.Join("a", "h:1", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s1",
                                      &retried);
  EXPECT_FALSE(retried);
  EXPECT_NE(late.id, first.id);
}

TEST(MembershipTest, AnAbandonedJoinLeavesNoMember) {
  FakeClock clock(1000);
  Membership membership(&clock, /*lease_ms=*/5000);
  WorkerRecord a = membership.Join("a", "h:1", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s1");
  WorkerRecord b = membership.Join("b", "h:2", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s2");
  EXPECT_FALSE(membership.Abandon(a.id, "another session"));
  EXPECT_TRUE(membership.Abandon(a.id, "s1"));
  EXPECT_FALSE(membership.Knows(a.id));
  EXPECT_EQ(membership.NameOf(a.id), a.id);  // unknown: the id itself
  EXPECT_EQ(membership.NameOf(b.id), "b");    // the index survived the erase
  EXPECT_TRUE(membership.Heartbeat(b.id, 0, 1));
  // A retry was answered with the member before the first attempt gave
  // up: the member stays.
  membership.Join("c", "h:3", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s3");
  bool retried = false;
  WorkerRecord c = membership.Join("c", "h:3", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s3",
                                   &retried);
  ASSERT_TRUE(retried);
  EXPECT_FALSE(membership.Abandon(c.id, "s3"));
  EXPECT_TRUE(membership.Knows(c.id));
  EXPECT_EQ(membership.LiveWorkers().size(), 2u);
  // Ids are never given out again.
  EXPECT_EQ(membership.Join("d", "h:4", {}).id, "w3");
}

// The heartbeat path's shared list of peers: a newcomer is appended, a
// list a caller holds never changes under it, and a departure is seen.
TEST(MembershipTest, TheSharedPeersFollowJoinsAndDepartures) {
  FakeClock clock(1000);
  Membership membership(&clock, /*lease_ms=*/5000);
  const WorkerRecord a = membership.Join("a", "h:1", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s1");
  membership.Join("relay", "h:9", {}, "", v1::MEMBER_ROLE_RELAY, {}, "s9");
  const auto first = membership.SharedLivePeers();
  ASSERT_EQ(first->size(), 1u);
  EXPECT_EQ(first->front().address, "h:1");
  EXPECT_TRUE(first->front().stats.ByteSizeLong() == 0);  // light: no heartbeat figures
  EXPECT_EQ(membership.SharedLivePeers(), first);         // not rebuilt per call
  const WorkerRecord b = membership.Join("b", "h:2", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s2");
  const auto second = membership.SharedLivePeers();
  EXPECT_EQ(first->size(), 1u);  // held: copied, not changed
  ASSERT_EQ(second->size(), 2u);
  EXPECT_EQ(second->back().id, b.id);
  EXPECT_TRUE(membership.Leave(a.id, "done"));
  const auto third = membership.SharedLivePeers();
  ASSERT_EQ(third->size(), 1u);
  EXPECT_EQ(third->front().id, b.id);
}

// The state file's members are reused while this version stands: every
// change of what it keeps moves it, a heartbeat does not.
TEST(MembershipTest, ThePersistedVersionMovesWithWhatTheStateKeeps) {
  FakeClock clock(1000);
  Membership membership(&clock, /*lease_ms=*/5000);
  uint64_t version = membership.persisted_version();
  auto moved = [&] {
    const uint64_t now = membership.persisted_version();
    const bool changed = now != version;
    version = now;
    return changed;
  };
  const WorkerRecord a = membership.Join("a", "h:1", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s1");
  const WorkerRecord b = membership.Join("b", "h:2", {}, "", v1::MEMBER_ROLE_WORKER, {}, "s2");
  EXPECT_TRUE(moved());
  EXPECT_TRUE(membership.Heartbeat(a.id, 0, 1));
  EXPECT_FALSE(moved());
  v1::Reachability reachable;
  reachable.set_known(true);
  membership.SetReachability(a.id, reachable);
  EXPECT_TRUE(moved());
  EXPECT_TRUE(membership.Leave(a.id, "done"));
  EXPECT_TRUE(moved());
  clock.AdvanceMs(6000);
  EXPECT_EQ(membership.ExpireLeases().size(), 1u);  // b
  EXPECT_TRUE(moved());
  EXPECT_TRUE(membership.ExpireLeases().empty());
  EXPECT_FALSE(moved());
  (void)b;
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

// What a stranger's heartbeat can make the coordinator keep is bounded: a
// link's sampled steps to the newest 16, an oversized link cleared, while a
// full honest link (16 samples and its strings) is kept whole.
TEST(MembershipTest, StatsAreBounded) {
  v1::StageStats stats;
  v1::LinkStats* honest = stats.add_links();
  honest->set_peer(std::string(64, 'p'));
  honest->set_codec_reason(std::string(200, 'r'));
  for (int i = 0; i < 40; ++i) {
    v1::StepRms* sample = honest->add_received_rms_by_step();
    sample->set_step(8 * i);
    sample->set_rms(1e-3 * (i + 1));
    sample->set_messages(4);
  }
  stats.add_links()->set_codec_reason(std::string(4096, 'x'));
  const v1::StageStats bounded = BoundedStageStats(stats);
  ASSERT_EQ(bounded.links_size(), 2);
  ASSERT_EQ(bounded.links(0).received_rms_by_step_size(), 16);
  EXPECT_EQ(bounded.links(0).received_rms_by_step(0).step(), 8 * 24);
  EXPECT_EQ(bounded.links(0).received_rms_by_step(15).step(), 8 * 39);
  EXPECT_EQ(bounded.links(0).codec_reason(), honest->codec_reason());
  EXPECT_TRUE(bounded.links(1).codec_reason().empty());
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
