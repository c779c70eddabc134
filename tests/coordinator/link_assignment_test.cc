// Who dials each link: ReachabilityManager's verdicts and relays, through the controller.
#include "controller_fixtures.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

// Who dials each link: by the reachability found at join.
class LinkAssignmentTest : public ReplanTest {
 protected:
  std::string JoinAs(const std::string& name, bool reachable,
                     v1::MemberRole role = v1::MEMBER_ROLE_WORKER) {
    v1::JoinRequest request;
    request.set_name(name);
    request.set_address(name + ":1");
    request.set_role(role);
    if (role != v1::MEMBER_ROLE_RELAY) request.mutable_device()->set_matmul_gflops(10);
    v1::Reachability reach;
    reach.set_known(true);
    reach.set_reachable(reachable);
    reach.set_detail(reachable ? "dialled" : "could not dial");
    absl::StatusOr<v1::JoinResponse> joined = controller_->Join(request, "", reach);
    EXPECT_TRUE(joined.ok()) << joined.status();
    return joined.ok() ? joined->worker_id() : "";
  }
  const v1::PlannedLink& LinkOf(const v1::Plan& plan, const std::string& up,
                                const std::string& down) {
    for (const v1::PlannedLink& l : plan.links()) {
      if (l.upstream_worker() == up && l.downstream_worker() == down) return l;
    }
    ADD_FAILURE() << "no link " << up << " -> " << down;
    static const v1::PlannedLink none;
    return none;
  }
};

TEST_F(LinkAssignmentTest, TheReachableEndDialsAndTwoUnreachableEndsMeetAtARelay) {
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
        "min_workers: 3 lease_ms: 1000");
  const std::string relay = JoinAs("relay", true, v1::MEMBER_ROLE_RELAY);
  const std::string a = JoinAs("a", true), b = JoinAs("b", false), c = JoinAs("c", false);
  const v1::Plan plan = Plan();
  ASSERT_EQ(plan.stages_size(), 3);
  for (const v1::StageAssignment& s : plan.stages()) EXPECT_NE(s.worker_id(), relay);
  EXPECT_EQ(LinkOf(plan, a, b).dialer(), v1::LINK_DIALER_DOWNSTREAM);
  const v1::PlannedLink& relayed = LinkOf(plan, b, c);
  EXPECT_EQ(relayed.dialer(), v1::LINK_DIALER_RELAY);
  EXPECT_EQ(relayed.relay_worker(), relay);
  EXPECT_EQ(relayed.relay_address(), "relay:1");
  EXPECT_EQ(relayed.rendezvous().size(), 32u);
  const v1::ClusterStatus status = controller_->Status();
  ASSERT_EQ(status.links_size(), 2);
  EXPECT_EQ(status.links(0).dialer(), "downstream");
  EXPECT_EQ(status.links(1).dialer(), "relay");
  for (const v1::WorkerStatus& w : status.workers()) {
    if (w.id() == relay) EXPECT_EQ(w.role(), "relay");
    if (w.id() == b) EXPECT_FALSE(w.reachable());
    if (w.id() == a) EXPECT_TRUE(w.reachable());
  }
}

TEST_F(LinkAssignmentTest, WithoutARelayTheLinkSaysWhatToDoAndARelayJoiningFixesIt) {
  const std::string a = JoinAs("a", false), b = JoinAs("b", false);
  v1::Plan plan = Plan();
  const v1::PlannedLink& none = LinkOf(plan, a, b);
  EXPECT_EQ(none.dialer(), v1::LINK_DIALER_NONE);
  EXPECT_NE(none.reason().find("start geotrain-relay"), std::string::npos) << none.reason();
  EXPECT_TRUE(HasEvent("link_needs_relay"));
  const std::string relay = JoinAs("relay", true, v1::MEMBER_ROLE_RELAY);
  plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  EXPECT_EQ(LinkOf(plan, a, b).dialer(), v1::LINK_DIALER_RELAY);
  EXPECT_EQ(LinkOf(plan, a, b).relay_worker(), relay);
}

TEST_F(LinkAssignmentTest, ALostRelayedLinkMovesToAnotherRelay) {
  const std::string r1 = JoinAs("r1", true, v1::MEMBER_ROLE_RELAY);
  const std::string r2 = JoinAs("r2", true, v1::MEMBER_ROLE_RELAY);
  const std::string a = JoinAs("a", false), b = JoinAs("b", false);
  v1::Plan plan = Plan();
  ASSERT_EQ(LinkOf(plan, a, b).relay_worker(), r1);
  // Only a worker whose link runs through the relay may report it.
  const std::string outsider = JoinAs("outsider", true);
  EXPECT_FALSE(ReportLinkLost(outsider, r1, plan.epoch()).ok());
  EXPECT_EQ(Plan().epoch(), plan.epoch());
  EXPECT_TRUE(ReportLinkLost(a, r1, plan.epoch()).ok());
  plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  EXPECT_EQ(plan.stages(0).worker_id(), a);  // the same stages, relinked
  EXPECT_EQ(plan.stages(1).worker_id(), b);
  EXPECT_EQ(LinkOf(plan, a, b).relay_worker(), r2);
  // The other end's report of the same break changes nothing more.
  ReportLinkLost(b, r1, 1);
  EXPECT_EQ(Plan().epoch(), 2u);
}

TEST_F(LinkAssignmentTest, WithItsOnlyRelaySuspendedALinkWaitsForItsNextHeartbeat) {
  const std::string r = JoinAs("r", true, v1::MEMBER_ROLE_RELAY);
  const std::string a = JoinAs("a", false), b = JoinAs("b", false);
  ASSERT_TRUE(ReportLinkLost(a, r, Plan().epoch()).ok());
  EXPECT_EQ(LinkOf(Plan(), a, b).dialer(), v1::LINK_DIALER_NONE);
  const uint64_t stranded = Plan().epoch();
  clock_.AdvanceMs(100);
  Heartbeat(r, 0);  // the relay is alive after all
  controller_->Tick();
  EXPECT_GT(Plan().epoch(), stranded);
  EXPECT_EQ(LinkOf(Plan(), a, b).relay_worker(), r);
}

TEST_F(LinkAssignmentTest, ARelayThatDiesIsReplacedByAnotherOnItsLeaseEnd) {
  const std::string r1 = JoinAs("r1", true, v1::MEMBER_ROLE_RELAY);
  const std::string r2 = JoinAs("r2", true, v1::MEMBER_ROLE_RELAY);
  const std::string a = JoinAs("a", false), b = JoinAs("b", false);
  ASSERT_EQ(LinkOf(Plan(), a, b).relay_worker(), r1);
  for (int t = 0; t < 15; ++t) {  // r1 falls silent
    clock_.AdvanceMs(100);
    Heartbeat(a, 0);
    Heartbeat(b, 0);
    Heartbeat(r2, 0);
    controller_->Tick();
  }
  EXPECT_EQ(LinkOf(Plan(), a, b).relay_worker(), r2);
}

TEST_F(LinkAssignmentTest, PeersDialAJoinerBackAndHalfOfAllProbesMustSucceed) {
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
        "min_workers: 4 lease_ms: 1000");
  const std::string a = JoinAs("a", true), c = JoinAs("c", true);
  const std::string d = JoinAs("d", true);
  // The coordinator reached b (it shares b's network), but its peers cannot.
  const std::string b = JoinAs("b", true);
  auto heartbeat = [&](const std::string& id, std::vector<v1::ProbeResult> results) {
    v1::HeartbeatRequest request;
    request.set_worker_id(id);
    for (auto& r : results) *request.add_probe_results() = r;
    v1::HeartbeatResponse response;
    EXPECT_TRUE(controller_->Heartbeat(request, &response));
    return response;
  };
  auto result = [](const std::string& id, bool reachable) {
    v1::ProbeResult r;
    r.set_worker_id(id);
    r.set_reachable(reachable);
    r.set_detail(reachable ? "in 1ms" : "no answer within 2s");
    return r;
  };
  std::vector<std::string> asked;
  for (const std::string& peer : {a, c, d}) {
    const v1::HeartbeatResponse response = heartbeat(peer, {});
    for (const v1::ProbeTask& task : response.probes()) {
      // Reachability probes (measure tasks for the link matrix are others).
      if (task.worker_id() == b && task.measure_bytes() == 0) {
        EXPECT_EQ(task.address(), "b:1");
        asked.push_back(peer);
      }
    }
  }
  ASSERT_EQ(asked.size(), 2u);
  const std::string not_asked = asked[0] != a && asked[1] != a ? a : asked[0] != c && asked[1] != c ? c : d;
  const uint64_t epoch = Plan().epoch();
  // A result from a worker that was not asked counts for nothing.
  heartbeat(not_asked, {result(b, false)});
  heartbeat(asked[0], {result(b, false)});
  auto reachable_b = [&] {
    const v1::ClusterStatus status = controller_->Status();
    for (const v1::WorkerStatus& w : status.workers()) {
      if (w.id() == b) return w.reachable();
    }
    return false;
  };
  EXPECT_TRUE(reachable_b());  // no verdict before every peer asked has answered
  heartbeat(asked[1], {result(b, false)});
  EXPECT_FALSE(reachable_b());  // 1 of 3 probes
  EXPECT_TRUE(HasEvent("reachability"));
  // b holds a stage: its links are assigned anew.
  const v1::Plan relinked = Plan();
  EXPECT_GT(relinked.epoch(), epoch);
  for (const v1::PlannedLink& l : relinked.links()) {
    if (l.downstream_worker() == b) EXPECT_NE(l.dialer(), v1::LINK_DIALER_UPSTREAM);
  }
}

}  // namespace
}  // namespace geotrain
