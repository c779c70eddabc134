// PlanManager under the network planner: voluntary moves and pipelines it wants.
#include "controller_fixtures.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

// How often `worker` appears in `plan`: as a stage's worker or in any
// pipeline or replica.
int PlanMentions(const v1::Plan& plan, const std::string& worker) {
  int count = 0;
  for (const v1::StageAssignment& stage : plan.stages()) {
    count += stage.worker_id() == worker;
    for (const v1::Replica& r : stage.replicas()) count += r.worker_id() == worker;
  }
  return count;
}

// The network planner online: fresh figures, a better plan, a decision.
class VoluntaryReplanTest : public HostileInputTest {
 protected:
  void SetUp() override {
    planner_ = "network";
    Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 1000 "
          "min_workers: 3 lease_ms: 1000000 checkpoint_every: 1");
  }
  // `slowdown`: how many times slower than the others this worker is.
  void ReportTimings(const std::string& id, double slowdown = 1) {
    v1::HeartbeatRequest request;
    request.set_worker_id(id);
    (*request.mutable_layer_seconds_per_sample())["embed"] = 1e-4 * slowdown;
    (*request.mutable_layer_seconds_per_sample())["block"] = 1e-3 * slowdown;
    (*request.mutable_layer_seconds_per_sample())["head"] = 1e-3 * slowdown;
    controller_->Heartbeat(request);
  }
  // A fresh checkpoint of every layer of `plan`, by its stages' workers.
  void CheckpointEveryStage(const v1::Plan& plan) {
    for (const v1::StageAssignment& stage : plan.stages()) {
      for (int l = stage.layer_begin(); l < stage.layer_end(); ++l) {
        ASSERT_TRUE(
            controller_->checkpoint_gate().Save(FittingCheckpoint(stage.worker_id(), l, 0)).ok());
      }
    }
  }
  // Answers every measure task: `slow` pairs at 1 kb/s, the rest 1 Gb/s.
  void AnswerMeasureTasks(const std::vector<std::string>& workers,
                          const std::set<std::pair<std::string, std::string>>& slow) {
    for (int round = 0; round < 4; ++round) {
      for (const std::string& w : workers) {
        v1::HeartbeatRequest request;
        request.set_worker_id(w);
        v1::HeartbeatResponse response;
        controller_->Heartbeat(request, &response);
        v1::HeartbeatRequest answer;
        answer.set_worker_id(w);
        for (const v1::ProbeTask& task : response.probes()) {
          if (task.measure_bytes() == 0) continue;
          const bool is_slow = slow.count({w, task.worker_id()}) || slow.count({task.worker_id(), w});
          v1::ProbeResult* r = answer.add_probe_results();
          r->set_worker_id(task.worker_id());
          r->set_measured(true);
          r->set_reachable(true);
          r->set_rtt_s(0.001);
          r->set_rate_bps(is_slow ? 1e3 : 1e9);
        }
        // Every port at 2 Gb/s each way (the first plan waits for them).
        if (response.has_access_probe()) {
          v1::AccessProbeResult* access = answer.add_access_probe_results();
          access->set_measured(true);
          access->set_uplink_bps(2e9);
          access->set_downlink_bps(2e9);
          access->set_peers(response.access_probe().peers_size());
        }
        controller_->Heartbeat(answer);
      }
    }
  }
};

// An outer job under the network planner: a stage per block is slower per
// sample than whole copies of this small model syncing every 500 steps, so
// the workers train as several pipelines (the planner's choice of R), which
// the status shows.
class NetworkPipelinesTest : public VoluntaryReplanTest {
 protected:
  void SetUp() override { StartOuterJob(4); }
  void StartOuterJob(int min_workers) {
    planner_ = "network";
    Start(absl::StrCat("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 1000 "
                       "min_workers: ", min_workers,
                       " lease_ms: 1000000 microbatch_size: 4 microbatches: 2 "
                       "outer { inner_steps: 500 }"));
  }
  // Workers a, b, c and d, measured and planned: their ids.
  std::vector<std::string> PlanFourWorkers() {
    std::vector<std::string> ids;
    for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
    for (const std::string& id : ids) ReportTimings(id);
    AnswerMeasureTasks(ids, {});
    controller_->Tick();
    EXPECT_EQ(controller_->Status().state(), "training");
    return ids;
  }
};

TEST_F(NetworkPipelinesTest, AnOuterJobIsPlannedAsPipelinesWhereTheyPay) {
  PlanFourWorkers();
  const v1::Plan plan = Plan();
  EXPECT_GE(plan.pipelines(), 2) << plan.DebugString();
  const v1::ClusterStatus status = controller_->Status();
  EXPECT_EQ(status.pipelines(), plan.pipelines());
  EXPECT_EQ(status.prediction().planner(), "network");
  EXPECT_FALSE(status.prediction().exact());
  EXPECT_NE(status.prediction().explanation().find("pipeline 1:"), std::string::npos)
      << status.prediction().explanation();
}

// Workers keep arriving in a large swarm, each with its figures still to
// come: the first plan waits for them only a bounded time from when there
// were enough workers, then plans those whose figures are in (the others
// are standbys), and says how long the planner took over how many.
TEST_F(VoluntaryReplanTest, ArrivalsDoNotHoldTheFirstPlanPastThePreflightWait) {
  std::vector<std::string> measured;
  for (const char* name : {"a", "b", "c"}) measured.push_back(Join(name).worker_id());
  for (const std::string& id : measured) ReportTimings(id);
  AnswerMeasureTasks(measured, {});
  std::string newcomer;
  for (int t = 0; t < 120; ++t) {  // 12 s; a newcomer every 2 s
    if (t % 20 == 0) newcomer = Join(absl::StrCat("late", t)).worker_id();
    clock_.AdvanceMs(100);
    controller_->Tick();
  }
  ASSERT_EQ(controller_->Status().state(), "training");
  const v1::Plan plan = Plan();
  for (const v1::StageAssignment& stage : plan.stages()) {
    EXPECT_NE(stage.worker_id(), newcomer);  // its figures never came
  }
  const v1::ClusterStatus status = controller_->Status();
  // a, b, c and the first newcomer, whose 10 s without figures had passed
  // (it is planned on defaults, as before); not the one that just came.
  EXPECT_EQ(status.prediction().candidates(), 4);
  EXPECT_GT(status.prediction().planning_s(), 0);
}

// Under the network planner, standbys that join after the first plan form
// another pipeline where the planner would now choose more of them (join
// order forms one whenever a stage's worth of standbys waits).
class LateStandbysFormPipelinesTest : public NetworkPipelinesTest {
 protected:
  void SetUp() override { StartOuterJob(2); }
};

TEST_F(LateStandbysFormPipelinesTest, StandbysFormAPipelineWhereThePlannerWantsMore) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b"}) ids.push_back(Join(name).worker_id());
  for (const std::string& id : ids) ReportTimings(id);
  AnswerMeasureTasks(ids, {});
  controller_->Tick();
  ASSERT_EQ(controller_->Status().state(), "training");
  const v1::Plan first = Plan();
  ASSERT_GE(first.pipelines(), 2) << first.DebugString();
  // Within the interval nothing moves, however many standbys wait.
  std::vector<std::string> late;
  for (const char* name : {"c", "d", "e", "f"}) late.push_back(Join(name).worker_id());
  for (const std::string& id : late) ReportTimings(id);
  std::vector<std::string> everyone = ids;
  everyone.insert(everyone.end(), late.begin(), late.end());
  AnswerMeasureTasks(everyone, {});
  controller_->Tick();
  EXPECT_EQ(Plan().epoch(), first.epoch());
  clock_.AdvanceMs(31'000);
  controller_->Tick();
  const v1::Plan next = Plan();
  ASSERT_EQ(next.epoch(), first.epoch() + 1) << "no pipeline formed from the standbys";
  EXPECT_EQ(next.pipelines(), first.pipelines() + 1);
  EXPECT_EQ(next.stages_size(), first.stages_size()) << "formed at the plan's cuts";
  bool said = false;
  const v1::ClusterStatus status = controller_->Status();
  for (const v1::Event& e : status.events()) {
    said |= e.kind() == "replan_considered" &&
            e.detail().find("the network planner would train") != std::string::npos;
  }
  EXPECT_TRUE(said);
}

// A loss in an outer job is repaired in place: a slow standby takes the
// lost worker's place, and its pipeline sets the job's pace. When a fast
// worker arrives, the background check re-plans the pipelines as a whole.
TEST_F(NetworkPipelinesTest, ARepairedOuterPlanIsImprovedInTheBackground) {
  const std::vector<std::string> ids = PlanFourWorkers();
  const v1::Plan first = Plan();
  ASSERT_GE(first.pipelines(), 2) << first.DebugString();
  // A slow standby, then a loss in the last pipeline: the standby is put in
  // its place.
  const std::string slow = Join("slow").worker_id();
  ReportTimings(slow, /*slowdown=*/100);
  std::vector<std::string> everyone = ids;
  everyone.push_back(slow);
  AnswerMeasureTasks(everyone, {});
  const v1::StageAssignment& last_stage = first.stages(first.stages_size() - 1);
  std::string lost;
  for (const v1::Replica& r : last_stage.replicas()) {
    if (r.pipeline() == first.pipelines() - 1) lost = r.worker_id();
  }
  ASSERT_FALSE(lost.empty()) << first.DebugString();
  controller_->Leave(lost);
  controller_->Tick();
  const v1::Plan repaired = Plan();
  ASSERT_GT(repaired.epoch(), first.epoch());
  EXPECT_NE(PlanMentions(repaired, slow), 0) << "repaired with the standby: "
                                              << repaired.DebugString();
  // A fast worker arrives. Within the interval nothing moves.
  const std::string fast = Join("fast").worker_id();
  ReportTimings(fast);
  everyone.erase(std::find(everyone.begin(), everyone.end(), lost));
  everyone.push_back(fast);
  AnswerMeasureTasks(everyone, {});
  CheckpointEveryStage(repaired);
  controller_->Tick();
  EXPECT_EQ(Plan().epoch(), repaired.epoch());
  // The next check finds the slow pipeline, but the repair was a re-plan
  // a moment ago: the move waits for the policy's spacing, and says so.
  clock_.AdvanceMs(31'000);
  controller_->Tick();
  EXPECT_EQ(Plan().epoch(), repaired.epoch());
  EXPECT_TRUE(HasEvent("replan_considered"));
  clock_.AdvanceMs(90'000);
  controller_->Tick();
  const v1::Plan improved = Plan();
  ASSERT_GT(improved.epoch(), repaired.epoch()) << "no background improvement";
  EXPECT_EQ(PlanMentions(improved, slow), 0) << improved.DebugString();
  EXPECT_NE(PlanMentions(improved, fast), 0) << improved.DebugString();
  bool said = false;
  const v1::ClusterStatus status = controller_->Status();
  for (const v1::Event& e : status.events()) {
    said |= e.kind() == "replanned" && e.detail().find("voluntary: switch") != std::string::npos;
  }
  EXPECT_TRUE(said);
  EXPECT_EQ(status.pipelines(), improved.pipelines());
}

// The link figures are not persisted: a restarted coordinator sees the
// defaults (1 Gb/s) where the plan was made on slow links, and must not
// move a healthy pipeline on them. Its first voluntary check waits a whole
// interval, for fresh measurements (a restart test re-planned at once).
TEST_F(VoluntaryReplanTest, ARestartWaitsAnIntervalBeforeAVoluntaryMove) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c"}) ids.push_back(Join(name).worker_id());
  for (const std::string& id : ids) ReportTimings(id);
  std::set<std::pair<std::string, std::string>> every_pair;
  for (const std::string& u : ids) {
    for (const std::string& v : ids) {
      if (u != v) every_pair.insert({u, v});
    }
  }
  AnswerMeasureTasks(ids, every_pair);
  controller_->Tick();
  ASSERT_EQ(controller_->Status().state(), "training");
  const v1::Plan first = Plan();
  clock_.AdvanceMs(31'000);
  Restart();
  for (const std::string& id : ids) ReportTimings(id);  // each re-attaches
  controller_->Tick();
  EXPECT_EQ(Plan().epoch(), first.epoch());
  EXPECT_FALSE(HasEvent("replan_considered"));
  EXPECT_FALSE(HasEvent("replanned"));
}

TEST_F(VoluntaryReplanTest, AVoluntaryReplanMovesOffASlowLinkAndSaysWhy) {
  std::map<std::string, std::string> address;  // id -> address
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c"}) {
    ids.push_back(Join(name).worker_id());
    address[ids.back()] = std::string(name) + ":1";
  }
  // Pre-flight: no plan until the layer timings and the probes are in.
  for (const std::string& id : ids) ReportTimings(id);
  controller_->Tick();
  EXPECT_EQ(controller_->Status().state(), "waiting");
  AnswerMeasureTasks(ids, {});
  controller_->Tick();
  ASSERT_EQ(controller_->Status().state(), "training");
  const v1::Plan first = Plan();
  ASSERT_GE(first.stages_size(), 2);
  const v1::ClusterStatus planned = controller_->Status();
  for (const v1::WorkerStatus& w : planned.workers()) {
    EXPECT_EQ(w.uplink_bps(), 2e9) << w.name();
    EXPECT_EQ(w.downlink_bps(), 2e9) << w.name();
  }
  // The planner's W travels with the plan (and covers at least the stages).
  EXPECT_GE(first.in_flight(), first.stages_size());
  const std::string up = first.stages(0).worker_id(), down = first.stages(1).worker_id();
  // The live link between the first two stages turns out to be very slow.
  for (const auto& [from, to] : {std::make_pair(up, down), std::make_pair(down, up)}) {
    v1::HeartbeatRequest request;
    request.set_worker_id(from);
    v1::LinkStats* link = request.mutable_stats()->add_links();
    link->set_peer(address[to]);
    link->set_link_rate_bps(1e3);
    controller_->Heartbeat(request);
  }
  CheckpointEveryStage(first);
  clock_.AdvanceMs(31'000);
  controller_->Tick();
  const v1::Plan next = Plan();
  ASSERT_EQ(next.epoch(), first.epoch() + 1) << "no voluntary re-plan";
  for (int k = 0; k + 1 < next.stages_size(); ++k) {
    const std::pair<std::string, std::string> pair = {next.stages(k).worker_id(),
                                                      next.stages(k + 1).worker_id()};
    EXPECT_FALSE(pair == std::make_pair(up, down) || pair == std::make_pair(down, up))
        << "the slow pair is still adjacent";
  }
  bool said = false;
  const v1::ClusterStatus status = controller_->Status();
  for (const v1::Event& e : status.events()) {
    if (e.kind() == "replanned" && e.detail().find("voluntary: switch") != std::string::npos) {
      said = true;
      EXPECT_NE(e.detail().find("ms/sample"), std::string::npos) << e.detail();
      EXPECT_NE(e.detail().find("paid back"), std::string::npos) << e.detail();
    }
  }
  EXPECT_TRUE(said);
  // Checked again 30 s later: the plan is the best one; nothing happens.
  clock_.AdvanceMs(31'000);
  controller_->Tick();
  EXPECT_EQ(Plan().epoch(), next.epoch());
}

TEST_F(VoluntaryReplanTest, WithoutFreshCheckpointsTheMoveWaitsAndTheEventSaysSo) {
  std::map<std::string, std::string> address;
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c"}) {
    ids.push_back(Join(name).worker_id());
    address[ids.back()] = std::string(name) + ":1";
  }
  for (const std::string& id : ids) ReportTimings(id);
  AnswerMeasureTasks(ids, {});
  controller_->Tick();
  const v1::Plan first = Plan();
  ASSERT_GE(first.stages_size(), 2);
  v1::HeartbeatRequest request;
  request.set_worker_id(first.stages(0).worker_id());
  v1::LinkStats* link = request.mutable_stats()->add_links();
  link->set_peer(address[first.stages(1).worker_id()]);
  link->set_link_rate_bps(1e3);
  controller_->Heartbeat(request);
  clock_.AdvanceMs(31'000);
  controller_->Tick();
  EXPECT_EQ(Plan().epoch(), first.epoch());
  bool deferred = false;
  const v1::ClusterStatus status = controller_->Status();
  for (const v1::Event& e : status.events()) {
    if (e.kind() == "replan_considered" && e.detail().find("checkpoints") != std::string::npos) {
      deferred = true;
    }
  }
  EXPECT_TRUE(deferred);
}

}  // namespace
}  // namespace geotrain
