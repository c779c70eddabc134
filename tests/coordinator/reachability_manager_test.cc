// ReachabilityManager on its own: members on a FakeClock, probe answers
// given by hand.
#include "coordinator/reachability_manager.h"

#include <gtest/gtest.h>

#include "common/clock.h"

namespace geotrain {
namespace {

v1::Reachability Probed(bool reachable) {
  v1::Reachability r;
  r.set_known(true);
  r.set_reachable(reachable);
  r.set_detail(reachable ? "coordinator dialled it" : "coordinator could not");
  return r;
}

v1::ProbeResult Answer(const std::string& joiner, bool reachable) {
  v1::ProbeResult result;
  result.set_worker_id(joiner);
  result.set_reachable(reachable);
  result.set_detail(reachable ? "ok" : "timed out");
  return result;
}

TEST(ReachabilityManagerTest, TwoPeersDialAJoinerBackAndTheMajorityDecidesOnce) {
  FakeClock clock(1000);
  Membership membership(&clock, 5000);
  ReachabilityManager reachability(&membership, /*peer_probes=*/2);
  const std::string hidden = membership.Join("hidden", "10.0.0.1:1", {}, "",
                                             v1::MEMBER_ROLE_WORKER, Probed(false)).id;
  const std::string a = membership.Join("a", "a:1", {}, "", v1::MEMBER_ROLE_WORKER,
                                        Probed(true)).id;
  const std::string b = membership.Join("b", "b:1", {}, "", v1::MEMBER_ROLE_WORKER,
                                        Probed(true)).id;
  WorkerRecord joiner = membership.Join("c", "c:1", {}, "", v1::MEMBER_ROLE_WORKER,
                                        Probed(false));
  EXPECT_FALSE(reachability.HasTasks());
  reachability.AskPeersToProbe(joiner);
  ASSERT_TRUE(reachability.HasTasks());
  // The reachable peers are asked, not the hidden one; each task once.
  EXPECT_TRUE(reachability.TakeTasks(hidden).empty());
  std::vector<v1::ProbeTask> for_a = reachability.TakeTasks(a);
  ASSERT_EQ(for_a.size(), 1u);
  EXPECT_EQ(for_a[0].worker_id(), joiner.id);
  EXPECT_EQ(for_a[0].address(), "c:1");
  EXPECT_TRUE(reachability.TakeTasks(a).empty());
  EXPECT_EQ(reachability.TakeTasks(b).size(), 1u);
  EXPECT_FALSE(reachability.HasTasks());
  // Someone not asked is ignored; the first answer waits for the second.
  EXPECT_FALSE(reachability.RecordResult(hidden, Answer(joiner.id, true)).has_value());
  EXPECT_FALSE(reachability.RecordResult(a, Answer(joiner.id, true)).has_value());
  EXPECT_FALSE(reachability.RecordResult(a, Answer(joiner.id, true)).has_value()) << "again";
  std::optional<ReachabilityManager::Verdict> verdict =
      reachability.RecordResult(b, Answer(joiner.id, true));
  ASSERT_TRUE(verdict.has_value());
  // 2 of 3 dialled it (the coordinator could not): reachable, a change.
  EXPECT_TRUE(verdict->reachability.reachable());
  EXPECT_TRUE(verdict->changed);
  EXPECT_NE(verdict->summary.find("reachable by 2 of 3 probes"), std::string::npos)
      << verdict->summary;
  EXPECT_NE(verdict->summary.find("a dialled it"), std::string::npos) << verdict->summary;
  EXPECT_TRUE(membership.Find(joiner.id)->reachability.reachable());
  EXPECT_FALSE(reachability.RecordResult(b, Answer(joiner.id, false)).has_value())
      << "one verdict per join";
}

TEST(ReachabilityManagerTest, HalfTheProbesFailingIsStillReachableAndUnprobedJoinersAskNobody) {
  FakeClock clock(1000);
  Membership membership(&clock, 5000);
  ReachabilityManager reachability(&membership, 1);
  const std::string a = membership.Join("a", "a:1", {}).id;
  WorkerRecord joiner = membership.Join("c", "c:1", {}, "", v1::MEMBER_ROLE_WORKER,
                                        Probed(true));
  reachability.AskPeersToProbe(joiner);
  EXPECT_EQ(reachability.TakeTasks(a).size(), 1u);
  std::optional<ReachabilityManager::Verdict> verdict =
      reachability.RecordResult(a, Answer(joiner.id, false));
  ASSERT_TRUE(verdict.has_value());
  EXPECT_TRUE(verdict->reachability.reachable()) << "1 of 2: half must succeed";
  EXPECT_FALSE(verdict->changed);
  reachability.AskPeersToProbe(membership.Join("d", "d:1", {}));  // not probed
  EXPECT_FALSE(reachability.HasTasks());
}

TEST(ReachabilityManagerTest, ASuspendedRelayIsUsableAgainAfterItsNextHeartbeat) {
  FakeClock clock(1000);
  Membership membership(&clock, 5000);
  ReachabilityManager reachability(&membership, 2);
  const std::string r1 = membership.Join("r1", "r1:1", {}, "", v1::MEMBER_ROLE_RELAY).id;
  const std::string r2 = membership.Join("r2", "r2:1", {}, "", v1::MEMBER_ROLE_RELAY,
                                         Probed(false)).id;
  membership.Join("w", "w:1", {});
  // Workers are no relays, and an unreachable relay is no use.
  ASSERT_EQ(reachability.UsableRelays().size(), 1u);
  EXPECT_EQ(reachability.UsableRelays()[0].id, r1);
  EXPECT_TRUE(reachability.SuspendRelay(r1, clock.NowMs()));
  EXPECT_FALSE(reachability.SuspendRelay(r1, clock.NowMs() + 500)) << "the same break";
  EXPECT_TRUE(reachability.UsableRelays().empty());
  clock.AdvanceMs(100);
  ASSERT_TRUE(membership.Heartbeat(r1, 0, 0));
  EXPECT_EQ(reachability.UsableRelays().size(), 1u);
  reachability.Forget(r1);
  EXPECT_TRUE(reachability.SuspendRelay(r1, clock.NowMs())) << "forgotten";
  (void)r2;
}

}  // namespace
}  // namespace geotrain
