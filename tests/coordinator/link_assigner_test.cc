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

}  // namespace
}  // namespace geotrain
