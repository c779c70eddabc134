#include "coordinator/link_assigner.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

namespace geotrain {
namespace {

v1::Plan ThreeStages() {
  v1::Plan plan;
  for (const char* id : {"a", "b", "c"}) {
    v1::StageAssignment* stage = plan.add_stages();
    stage->set_stage(plan.stages_size() - 1);
    stage->set_worker_id(id);
  }
  plan.mutable_stages(1)->add_replicas()->set_worker_id("b2");
  return plan;
}

LinkAssignerInput Reachable(std::set<std::string> unreachable) {
  LinkAssignerInput input;
  input.reachable = [unreachable](const std::string& id) { return unreachable.count(id) == 0; };
  input.name_of = [](const std::string& id) { return "name-" + id; };
  return input;
}

TEST(LinkAssignerTest, TheReachableEndIsDialed) {
  v1::Plan plan = ThreeStages();
  AssignLinks(Reachable({"b2"}), &plan);
  // a->b, a->b2, b->c, b2->c: replicas get links of their own.
  ASSERT_EQ(plan.links_size(), 4);
  EXPECT_EQ(plan.links(0).dialer(), v1::LINK_DIALER_UPSTREAM);
  EXPECT_EQ(plan.links(1).downstream_worker(), "b2");
  EXPECT_EQ(plan.links(1).dialer(), v1::LINK_DIALER_DOWNSTREAM);  // b2 dials a
  EXPECT_NE(plan.links(1).reason().find("name-b2 is not reachable"), std::string::npos);
  EXPECT_EQ(plan.links(3).upstream_worker(), "b2");
  EXPECT_EQ(plan.links(3).dialer(), v1::LINK_DIALER_UPSTREAM);
}

TEST(LinkAssignerTest, PipelinesAreLinkedOnlyWithinThemselves) {
  v1::Plan plan;
  plan.set_pipelines(2);
  for (const char* id : {"a", "b"}) {
    v1::StageAssignment* stage = plan.add_stages();
    stage->set_stage(plan.stages_size() - 1);
    stage->set_worker_id(id);
    v1::Replica* other = stage->add_replicas();
    other->set_worker_id(std::string(id) + "1");
    other->set_pipeline(1);
  }
  AssignLinks(Reachable({}), &plan);
  // a->b and a1->b1, not a->b1 or a1->b; then the outer sync's a1->a and
  // b1->b (each stage's replica to its reducer in pipeline 0).
  ASSERT_EQ(plan.links_size(), 4);
  EXPECT_EQ(plan.links(0).upstream_worker(), "a");
  EXPECT_EQ(plan.links(0).downstream_worker(), "b");
  EXPECT_EQ(plan.links(1).upstream_worker(), "a1");
  EXPECT_EQ(plan.links(1).downstream_worker(), "b1");
  for (int i : {0, 1}) EXPECT_FALSE(plan.links(i).outer());
  EXPECT_EQ(plan.links(2).upstream_worker(), "a1");
  EXPECT_EQ(plan.links(2).downstream_worker(), "a");
  EXPECT_EQ(plan.links(3).upstream_worker(), "b1");
  EXPECT_EQ(plan.links(3).downstream_worker(), "b");
  for (int i : {2, 3}) {
    EXPECT_TRUE(plan.links(i).outer());
    EXPECT_EQ(plan.links(i).dialer(), v1::LINK_DIALER_UPSTREAM);
  }
}

TEST(LinkAssignerTest, ReplicasBehindNatMeetTheirReducerAtARelay) {
  v1::Plan plan;
  plan.set_pipelines(3);
  v1::StageAssignment* stage = plan.add_stages();
  stage->set_worker_id("r0");
  for (int p : {1, 2}) {
    v1::Replica* replica = stage->add_replicas();
    replica->set_worker_id("r" + std::to_string(p));
    replica->set_pipeline(p);
  }
  LinkAssignerInput input = Reachable({"r0", "r2"});  // only r1 accepts connections
  input.relays.resize(1);
  input.relays[0].id = "relay";
  input.relays[0].address = "192.0.2.9:7000";
  AssignLinks(input, &plan);
  ASSERT_EQ(plan.links_size(), 2);
  // r1 is reachable: the reducer dials it. Neither r2 nor r0 is: a relay.
  EXPECT_EQ(plan.links(0).upstream_worker(), "r1");
  EXPECT_EQ(plan.links(0).dialer(), v1::LINK_DIALER_DOWNSTREAM);
  EXPECT_EQ(plan.links(1).upstream_worker(), "r2");
  EXPECT_EQ(plan.links(1).downstream_worker(), "r0");
  EXPECT_EQ(plan.links(1).dialer(), v1::LINK_DIALER_RELAY);
  EXPECT_EQ(plan.links(1).relay_address(), "192.0.2.9:7000");
  EXPECT_EQ(plan.links(1).rendezvous().size(), 32u);
  // Each end sees the rendezvous and its own proof, as on a pipeline link.
  const v1::Plan replica_view = PlanViewFor(plan, "r2");
  EXPECT_EQ(replica_view.links(1).rendezvous(), plan.links(1).rendezvous());
  EXPECT_EQ(replica_view.links(1).upstream_proof(), plan.links(1).upstream_proof());
  EXPECT_TRUE(replica_view.links(1).downstream_proof().empty());
  const v1::Plan reducer_view = PlanViewFor(plan, "r0");
  EXPECT_EQ(reducer_view.links(1).downstream_proof(), plan.links(1).downstream_proof());
  EXPECT_TRUE(reducer_view.links(1).upstream_proof().empty());
}

TEST(LinkAssignerTest, TwoUnreachableEndsMeetAtTheLeastLoadedRelay) {
  v1::Plan plan = ThreeStages();
  LinkAssignerInput input = Reachable({"a", "b", "b2", "c"});
  AssignLinks(input, &plan);
  for (const v1::PlannedLink& link : plan.links()) {
    EXPECT_EQ(link.dialer(), v1::LINK_DIALER_NONE);
    EXPECT_NE(link.reason().find("start geotrain-relay"), std::string::npos) << link.reason();
  }
  input.relays.resize(2);
  input.relays[0].id = "r0";
  input.relays[0].address = "192.0.2.1:7000";
  input.relays[1].id = "r1";
  input.relays[1].address = "192.0.2.2:7000";
  AssignLinks(input, &plan);
  ASSERT_EQ(plan.links_size(), 4);  // replaced, not appended
  std::map<std::string, int> load;
  std::set<std::string> rendezvous;
  for (const v1::PlannedLink& link : plan.links()) {
    EXPECT_EQ(link.dialer(), v1::LINK_DIALER_RELAY);
    ++load[link.relay_worker()];
    EXPECT_EQ(link.rendezvous().size(), 32u);
    rendezvous.insert(link.rendezvous());
  }
  EXPECT_EQ(load["r0"], 2);
  EXPECT_EQ(load["r1"], 2);
  EXPECT_EQ(rendezvous.size(), 4u);  // each link its own
}

// Issue 32: any enrolled identity could read every relayed link's
// rendezvous from its plan and squat at the relay.
TEST(LinkAssignerTest, ARendezvousIsShownOnlyToItsEndsAndItsRelay) {
  v1::Plan plan = ThreeStages();
  LinkAssignerInput input = Reachable({"a", "b", "b2", "c"});
  input.relays.resize(1);
  input.relays[0].id = "r0";
  input.relays[0].address = "192.0.2.1:7000";
  AssignLinks(input, &plan);
  ASSERT_EQ(plan.links_size(), 4);
  auto shown = [](const v1::Plan& view) {
    std::set<std::pair<std::string, std::string>> links;
    for (const v1::PlannedLink& link : view.links()) {
      if (!link.rendezvous().empty()) {
        links.insert({link.upstream_worker(), link.downstream_worker()});
      }
    }
    return links;
  };
  using Links = std::set<std::pair<std::string, std::string>>;
  EXPECT_EQ(shown(PlanViewFor(plan, "a")), (Links{{"a", "b"}, {"a", "b2"}}));
  EXPECT_EQ(shown(PlanViewFor(plan, "c")), (Links{{"b", "c"}, {"b2", "c"}}));
  EXPECT_EQ(shown(PlanViewFor(plan, "r0")).size(), 4u);
  EXPECT_TRUE(shown(PlanViewFor(plan, "stranger")).empty());
  // Everything else is the same plan.
  v1::Plan view = PlanViewFor(plan, "stranger");
  EXPECT_EQ(view.links(0).relay_address(), "192.0.2.1:7000");
  EXPECT_EQ(view.stages_size(), 3);
}

}  // namespace
}  // namespace geotrain
