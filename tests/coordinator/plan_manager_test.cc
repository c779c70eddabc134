// PlanManager through the controller: re-plans around losses, replicas, pipelines.
#include "controller_fixtures.h"
#include "coordinator/plan_builder.h"

#include <gtest/gtest.h>

#include <future>
#include <map>
#include <thread>

namespace geotrain {
namespace {

// The join-order planner, held mid-search while armed: what a search of
// thousands of workers looks like to everything else.
class HeldPlanner : public Planner {
 public:
  HeldPlanner() : inner_(*MakePlannerByName("join-order")) {}
  std::string name() const override { return "held"; }
  absl::StatusOr<PipelinePlan> Plan(const PlannerInput& input) const override {
    if (armed_) {
      searching_.Notify();
      release_.WaitForNotification();
    }
    return inner_->Plan(input);
  }
  void Arm() { armed_ = true; }
  void AwaitSearch() { searching_.WaitForNotification(); }
  void Release() { release_.Notify(); }

 private:
  std::unique_ptr<Planner> inner_;
  std::atomic<bool> armed_{false};
  mutable absl::Notification searching_, release_;
};

TEST_F(ReplanTest, AStandbyTakesTheStageOfALostWorker) {
  const std::string a = Join("a").worker_id(), b = Join("b").worker_id();
  const std::string c = Join("c").worker_id();  // standby
  ASSERT_EQ(Plan().epoch(), 1u);
  for (int t = 0; t < 15; ++t) {  // b falls silent
    clock_.AdvanceMs(100);
    Heartbeat(a, 0);
    Heartbeat(c, 0);
    controller_->Tick();
  }
  const v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  EXPECT_EQ(plan.stages(0).worker_id(), a);
  EXPECT_EQ(plan.stages(1).worker_id(), c);
  EXPECT_TRUE(HasEvent("lost"));
  EXPECT_TRUE(HasEvent("replanned"));
  EXPECT_NE(plan.stages(1).worker_id(), b);
}

// A mass failure silences workers at once while their leases run on: the
// repair takes a standby it has heard from lately over a faster one that
// has fallen silent too (which would be lost next, and need a plan of its
// own).
TEST_F(ReplanTest, AStandbyHeardFromLatelyGoesBeforeAFasterSilentOne) {
  const std::string a = Join("a").worker_id(), b = Join("b").worker_id();
  ASSERT_EQ(Plan().epoch(), 1u);
  v1::JoinRequest fast;
  fast.set_name("fast");
  fast.set_address("fast:1");
  fast.mutable_device()->set_matmul_gflops(1000);
  const std::string silent_fast = controller_->Join(fast)->worker_id();
  const std::string slow = Join("slow").worker_id();
  // b and the fast standby fall silent together; the fast one's lease
  // runs longer, as it joined later.
  for (int t = 0; t < 15; ++t) {
    clock_.AdvanceMs(100);
    Heartbeat(a, 0);
    Heartbeat(slow, 0);
    if (t < 3) Heartbeat(silent_fast, 0);
    controller_->Tick();
  }
  const v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  EXPECT_EQ(plan.stages(1).worker_id(), slow);
  EXPECT_NE(plan.stages(1).worker_id(), b);
}

// Issue 34, at 10,000 workers: joins whose callers gave up, each holding a
// server thread while it waited for the plan's lock behind a search, took
// the coordinator to 4,000 threads. An abandoned join is queued instead and
// forgotten at the next Tick.
TEST_F(ReplanTest, AnAbandonedJoinNeverWaitsForASearch) {
  auto planner = std::make_shared<HeldPlanner>();
  custom_planner_ = planner;
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
        "min_workers: 3 lease_ms: 1000");
  Join("a");
  Join("b");
  planner->Arm();
  std::thread first_plan([this] { Join("c"); });  // the third: the first plan's search
  planner->AwaitSearch();
  v1::JoinRequest late;
  late.set_name("d");
  late.set_address("d:1");
  late.set_session_id("dd01");
  late.mutable_device()->set_matmul_gflops(10);
  absl::StatusOr<v1::JoinResponse> joined = controller_->Join(late);  // never waits either
  ASSERT_TRUE(joined.ok()) << joined.status();
  std::future<void> abandon = std::async(std::launch::async, [&] {
    controller_->AbandonJoin(joined->worker_id(), "dd01");
  });
  const bool returned = abandon.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  planner->Release();
  first_plan.join();
  ASSERT_TRUE(returned) << "AbandonJoin waited for the search";
  EXPECT_TRUE(controller_->KnowsWorker(joined->worker_id()));  // until the next Tick
  controller_->Tick();
  EXPECT_FALSE(controller_->KnowsWorker(joined->worker_id()));
  EXPECT_EQ(controller_->Status().workers_size(), 3);
}

// A search looks at max_planner_candidates workers at most: the plan's
// members, then those heard from lately, then the fastest. (At 10,000
// workers its input, a link for each pair, took 3 GiB and minutes.)
TEST_F(ReplanTest, ASearchLooksAtTheFastestCandidatesOnly) {
  max_planner_candidates_ = 2;
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
        "min_workers: 4 lease_ms: 1000");
  std::map<std::string, std::string> ids;
  for (const auto& [name, gflops] :
       std::vector<std::pair<std::string, double>>{{"a", 10}, {"b", 300}, {"c", 20}, {"d", 200}}) {
    v1::JoinRequest request;
    request.set_name(name);
    request.set_address(name + ":1");
    request.mutable_device()->set_matmul_gflops(gflops);
    ids[name] = controller_->Join(request)->worker_id();
  }
  const v1::Plan plan = Plan();
  std::set<std::string> planned;
  for (const v1::StageAssignment& stage : plan.stages()) {
    planned.insert(stage.worker_id());
    for (const v1::Replica& r : stage.replicas()) planned.insert(r.worker_id());
  }
  EXPECT_EQ(planned, (std::set<std::string>{ids["b"], ids["d"]}));
  // Join order among them: d joined after b.
  EXPECT_EQ(plan.stages(0).worker_id(), ids["b"]);
  EXPECT_EQ(controller_->Status().prediction().candidates(), 2);
}

TEST_F(ReplanTest, WithoutAStandbyTheLayersAreRepartitioned) {
  const std::string a = Join("a").worker_id();
  Join("b");
  ASSERT_EQ(Plan().stages_size(), 2);
  for (int t = 0; t < 15; ++t) {
    clock_.AdvanceMs(100);
    Heartbeat(a, 0);
    controller_->Tick();
  }
  const v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  ASSERT_EQ(plan.stages_size(), 1);
  EXPECT_EQ(plan.stages(0).worker_id(), a);
  EXPECT_EQ(plan.stages(0).layer_begin(), 0);
  EXPECT_EQ(plan.stages(0).layer_end(), 4);
}

// Replicas: 5 layers over 3 stages, the middle one with up to 2 workers.
class ReplicaPlanTest : public ReplanTest {
 protected:
  void SetUp() override {
    Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 3 } text {} steps: 3 "
          "schedule: SCHEDULE_ASYNC_STASH min_workers: 4 max_stages: 3 replicas: 2 "
          "lease_ms: 1000");
  }
};

TEST_F(ReplicaPlanTest, ExtraWorkersReplicateTheMiddleStage) {
  const std::string a = Join("a").worker_id(), b = Join("b").worker_id();
  const std::string c = Join("c").worker_id(), d = Join("d").worker_id();
  const v1::Plan plan = Plan();
  ASSERT_EQ(plan.stages_size(), 3);
  EXPECT_EQ(plan.stages(0).replicas_size(), 0);
  EXPECT_EQ(plan.stages(2).replicas_size(), 0);
  ASSERT_EQ(plan.stages(1).replicas_size(), 1);
  const v1::ClusterStatus status = controller_->Status();
  int replicas = 0;
  for (const v1::WorkerStatus& w : status.workers()) {
    EXPECT_EQ(w.state(), v1::WORKER_STATE_TRAINING) << w.name();
    if (w.replica() == 1) {
      ++replicas;
      EXPECT_EQ(w.stage(), 1);
    }
  }
  EXPECT_EQ(replicas, 1);
  // The middle stage has its 2 workers: a fifth replicates stage 0, and a
  // sixth is a standby (the last stage is never replicated).
  const std::string e = Join("e").worker_id();
  const v1::Plan with_e = Plan();
  EXPECT_EQ(with_e.epoch(), 2u);
  ASSERT_EQ(with_e.stages(0).replicas_size(), 1);
  EXPECT_EQ(with_e.stages(0).replicas(0).worker_id(), e);
  EXPECT_EQ(with_e.stages(0).worker_id(), plan.stages(0).worker_id());
  EXPECT_EQ(with_e.stages(1).replicas_size(), 1);
  EXPECT_EQ(with_e.stages(2).replicas_size(), 0);
  Join("f");
  EXPECT_EQ(Plan().epoch(), 2u);
}

// Pipelines (job.outer): 4 workers, 2 stages each, become 2 pipelines; a
// lost worker stops only its own pipeline.
class PipelinesPlanTest : public ReplanTest {
 protected:
  void SetUp() override { StartPipelinesJob(3); }
  void StartPipelinesJob(int steps) {
    Start(absl::StrCat("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: ", steps,
                       " schedule: SCHEDULE_ASYNC_STASH min_workers: 4 max_stages: 2 "
                       "lease_ms: 1000 microbatches: 2 outer { inner_steps: 5 }"));
  }
};

TEST_F(PipelinesPlanTest, FullPipelinesAndALostWorkerDissolvesOnlyItsOwn) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  const v1::Plan plan = Plan();
  ASSERT_EQ(plan.pipelines(), 2);
  ASSERT_EQ(plan.stages_size(), 2);
  // Join order: pipeline 0 is a -> b, pipeline 1 is c -> d.
  EXPECT_EQ(WorkersOf(plan.stages(0), 0)[0].id, ids[0]);
  EXPECT_EQ(WorkersOf(plan.stages(1), 0)[0].id, ids[1]);
  EXPECT_EQ(WorkersOf(plan.stages(0), 1)[0].id, ids[2]);
  EXPECT_EQ(WorkersOf(plan.stages(1), 1)[0].id, ids[3]);
  // a->b and c->d; then the outer sync's c->a and d->b.
  ASSERT_EQ(plan.links_size(), 4);
  EXPECT_FALSE(plan.links(1).outer());
  EXPECT_TRUE(plan.links(2).outer());
  EXPECT_EQ(plan.links(2).upstream_worker(), ids[2]);
  EXPECT_EQ(plan.links(2).downstream_worker(), ids[0]);
  v1::ClusterStatus status = controller_->Status();
  EXPECT_EQ(status.pipelines(), 2);
  ASSERT_EQ(status.pipeline_status_size(), 2);
  EXPECT_EQ(status.pipeline_status(1).workers_size(), 2);
  for (const v1::WorkerStatus& w : status.workers()) {
    EXPECT_EQ(w.pipeline(), w.id() == ids[2] || w.id() == ids[3] ? 1 : 0) << w.name();
  }
  // d (pipeline 1's last stage) falls silent; no standby: pipeline 1 goes,
  // pipeline 0 keeps its workers and places. Pipeline 0's stage 0 (a) has
  // finished step 2 meanwhile; the job's step waits for pipeline 1.
  for (int t = 0; t < 15; ++t) {
    clock_.AdvanceMs(100);
    for (const std::string& id : ids) {
      if (id != ids[3]) Heartbeat(id, 0);
    }
    v1::HeartbeatRequest at_step_2;  // a's own heartbeat says how far it is
    at_step_2.set_worker_id(ids[0]);
    at_step_2.set_epoch(plan.epoch());
    at_step_2.set_step(2);
    controller_->Heartbeat(at_step_2);
    controller_->Tick();
  }
  const v1::Plan after = Plan();
  EXPECT_EQ(after.epoch(), 2u);
  EXPECT_LE(after.pipelines(), 1);
  EXPECT_EQ(after.stages(0).worker_id(), ids[0]);
  EXPECT_EQ(after.stages(1).worker_id(), ids[1]);
  EXPECT_EQ(WorkersInPlan(after), 2);
  // The next plan's data begins past what pipeline 0 drew (its 2 steps,
  // and a window more in flight), not at the job's step: no sample twice.
  EXPECT_EQ(after.start_step(), 0);
  const int in_flight_steps = (kMaxPlannedWindow + 1) / 2;  // microbatches: 2
  EXPECT_EQ(after.data_base(), uint64_t{(2 + 1 + in_flight_steps) * 2 * 2});
  EXPECT_TRUE(HasEvent("replanned"));
  // A newcomer stands by, and c is a standby again.
  EXPECT_EQ(StageOf(after, ids[2]), nullptr);
}

// A pipeline that finished first: its workers report DONE and exit; their
// leases running out while the other pipeline finishes is no reason to
// dissolve anything.
TEST_F(PipelinesPlanTest, WorkersThatReportedDoneAreNotLost) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  const v1::Plan plan = Plan();
  ASSERT_EQ(plan.pipelines(), 2);
  TrainSteps(ids[0], ids[1], 3, plan.epoch());  // pipeline 0: a -> b
  TrainSteps(ids[2], ids[3], 3, plan.epoch());  // pipeline 1: c -> d
  for (int k : {0, 1}) {
    v1::DoneReport done;
    done.set_worker_id(ids[k]);
    done.set_step(3);
    ASSERT_TRUE(controller_->ReportDone(done).ok()) << k;
  }
  // a and b have exited; c and d finish their final round meanwhile.
  for (int t = 0; t < 15; ++t) {
    clock_.AdvanceMs(100);
    Heartbeat(ids[2], 0);
    Heartbeat(ids[3], 0);
    controller_->Tick();
  }
  EXPECT_EQ(Plan().epoch(), plan.epoch()) << "re-planned around finished workers";
  EXPECT_FALSE(HasEvent("replanned"));
  // Their leases ended (1 s), and they are counted finished, not lost.
  EXPECT_TRUE(HasEvent("finished"));
  EXPECT_FALSE(HasEvent("lost"));
  for (int k : {2, 3}) {
    v1::DoneReport done;
    done.set_worker_id(ids[k]);
    done.set_step(3);
    ASSERT_TRUE(controller_->ReportDone(done).ok()) << k;
  }
  EXPECT_TRUE(HasEvent("job_done"));
}

// Churn in pipeline 1 leaves pipeline 0 alone (pipeline_continuity.h): d
// is lost with no standby, pipeline 1 is dissolved and pipeline 0 goes on
// under the epoch it was formed in (its reports still count, its links'
// old news does not act); a newcomer and the standing-by c then form
// pipeline 1 anew, on its own data lane, at pipeline 0's step.
// The same job, long enough for steps after two re-plans.
class LongPipelinesPlanTest : public PipelinesPlanTest {
 protected:
  void SetUp() override { StartPipelinesJob(20); }
};

TEST_F(LongPipelinesPlanTest, APipelineGoesOnThroughAnotherPipelinesChurn) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  const v1::Plan plan = Plan();
  ASSERT_EQ(plan.pipelines(), 2);
  ASSERT_EQ(plan.pipeline_info_size(), 2);
  EXPECT_EQ(plan.pipeline_info(1).data_lane(), 1);
  TrainSteps(ids[0], ids[1], 1, 1);
  TrainSteps(ids[2], ids[3], 1, 1);
  for (int t = 0; t < 15; ++t) {  // d falls silent
    clock_.AdvanceMs(100);
    for (int k : {0, 1, 2}) Heartbeat(ids[k], 0);
    controller_->Tick();
  }
  const v1::Plan alone = Plan();
  ASSERT_EQ(alone.epoch(), 2u);
  EXPECT_LE(alone.pipelines(), 1);
  ASSERT_EQ(alone.pipeline_info_size(), 1);
  EXPECT_EQ(alone.pipeline_info(0).formed_epoch(), 1u);  // it goes on
  EXPECT_EQ(alone.pipeline_info(0).data_stride(), 2);
  EXPECT_TRUE(HasEvent("pipelines_continue"));
  // Pipeline 0 reports under epoch 1, as its workers still run it.
  for (int step = 2; step <= 4; ++step) {
    v1::StepReport report;
    report.set_worker_id(ids[1]);
    report.set_epoch(1);
    report.set_step(step);
    report.set_loss(2.0);
    report.set_samples(8);
    const absl::Status reported = controller_->ReportStep(report);
    ASSERT_TRUE(reported.ok()) << step << ": " << reported;
    FinishedOnStageZero(ids[0], step, 1);
  }
  EXPECT_EQ(controller_->Status().step(), 4);  // pipeline 0 alone commits now
  v1::StepReport wrong_epoch;
  wrong_epoch.set_worker_id(ids[1]);
  wrong_epoch.set_epoch(2);
  wrong_epoch.set_step(5);
  wrong_epoch.set_samples(8);
  EXPECT_FALSE(controller_->ReportStep(wrong_epoch).ok());
  // A lost link of an epoch pipeline 0's links do not carry is old news.
  v1::WorkerEvent stale;
  stale.set_worker_id(ids[1]);
  stale.set_kind("link_lost");
  stale.set_peer(ids[0]);
  stale.set_epoch(2);
  ASSERT_TRUE(controller_->RecordWorkerEvent(stale).ok());
  EXPECT_EQ(Plan().epoch(), 2u);
  // e joins: with c, a standby per stage, pipeline 1 is formed anew.
  const std::string e = Join("e").worker_id();
  const v1::Plan formed = Plan();
  ASSERT_EQ(formed.epoch(), 3u);
  ASSERT_EQ(formed.pipelines(), 2);
  ASSERT_EQ(formed.pipeline_info_size(), 2);
  EXPECT_EQ(formed.pipeline_info(0).SerializeAsString(),
            alone.pipeline_info(0).SerializeAsString());
  const v1::PipelineInfo& fresh = formed.pipeline_info(1);
  EXPECT_EQ(fresh.formed_epoch(), 3u);
  EXPECT_EQ(fresh.data_lane(), 1);
  EXPECT_EQ(fresh.start_step(), 4);  // where pipeline 0's stage 0 is
  EXPECT_GE(fresh.data_base(), formed.data_base());
  std::set<std::string> pipeline1;
  for (const v1::StageAssignment& stage : formed.stages()) {
    for (const StageWorker& w : WorkersOf(stage, 1)) pipeline1.insert(w.id);
  }
  EXPECT_EQ(pipeline1, (std::set<std::string>{ids[2], e}));
  EXPECT_TRUE(HasEvent("replanned"));
  // The new pipeline's last stage reports under epoch 3 from step 5.
  const std::string last1 = WorkersOf(formed.stages(1), 1)[0].id;
  v1::StepReport fresh_step;
  fresh_step.set_worker_id(last1);
  fresh_step.set_epoch(3);
  fresh_step.set_step(5);
  fresh_step.set_loss(2.0);
  fresh_step.set_samples(8);
  EXPECT_TRUE(controller_->ReportStep(fresh_step).ok());
}

TEST_F(ReplicaPlanTest, ALostReplicaLeavesItsStageToTheOther) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  const v1::Plan before = Plan();
  const std::string primary = before.stages(1).worker_id();
  const std::string replica = before.stages(1).replicas(0).worker_id();
  for (int t = 0; t < 15; ++t) {  // the primary of stage 1 falls silent
    clock_.AdvanceMs(100);
    for (const std::string& id : ids) {
      if (id != primary) Heartbeat(id, 0);
    }
    controller_->Tick();
  }
  v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  EXPECT_EQ(plan.stages(1).worker_id(), replica);  // promoted, keeps its weights
  EXPECT_EQ(plan.stages(1).replicas_size(), 0);
  for (int k : {0, 2}) EXPECT_EQ(plan.stages(k).worker_id(), before.stages(k).worker_id());

  // The worker comes back under a new id and is a replica again.
  const std::string back = Join("a2").worker_id();
  plan = Plan();
  EXPECT_EQ(plan.epoch(), 3u);
  ASSERT_EQ(plan.stages(1).replicas_size(), 1);
  EXPECT_EQ(plan.stages(1).replicas(0).worker_id(), back);
}

TEST_F(ReplicaPlanTest, AReplicaFillsAnOrphanedStageWithoutAStandby) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  const v1::Plan before = Plan();
  const std::string last = before.stages(2).worker_id();
  const std::string replica = before.stages(1).replicas(0).worker_id();
  for (int t = 0; t < 15; ++t) {
    clock_.AdvanceMs(100);
    for (const std::string& id : ids) {
      if (id != last) Heartbeat(id, 0);
    }
    controller_->Tick();
  }
  const v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  ASSERT_EQ(plan.stages_size(), 3);  // no re-partition
  EXPECT_EQ(plan.stages(2).worker_id(), replica);
  EXPECT_EQ(plan.stages(1).replicas_size(), 0);
}

TEST_F(ReplicaPlanTest, TheJobEndsWhenEveryWorkerIncludingReplicasIsDone) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  const v1::Plan plan = Plan();
  TrainSteps(plan.stages(0).worker_id(), plan.stages(2).worker_id(), 3);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_FALSE(controller_->done());
    v1::DoneReport done;
    done.set_worker_id(ids[i]);
    done.set_step(3);
    ASSERT_TRUE(controller_->ReportDone(done).ok());
  }
  EXPECT_TRUE(controller_->done());
}

TEST_F(ReplicaPlanTest, ASlowReplicaIsDemotedAndNotReplicatedAgain) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  const v1::Plan before = Plan();
  const std::string slow = before.stages(1).replicas(0).worker_id();
  for (int t = 0; t < 60; ++t) {  // 5x its sibling, for 6 s
    clock_.AdvanceMs(100);
    for (const std::string& id : ids) Heartbeat(id, id == slow ? 0.050 : 0.010);
    controller_->Tick();
  }
  EXPECT_TRUE(HasEvent("straggler"));
  const v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  EXPECT_EQ(plan.stages(1).worker_id(), before.stages(1).worker_id());
  EXPECT_EQ(plan.stages(1).replicas_size(), 0);  // a standby now, not re-added
  const v1::ClusterStatus status = controller_->Status();
  for (const v1::WorkerStatus& w : status.workers()) {
    if (w.id() == slow) EXPECT_EQ(w.state(), v1::WORKER_STATE_STANDBY);
  }
}

TEST_F(ReplicaPlanTest, AReplicaAccusedOfALostLinkIsNotReaddedAtOnce) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  const std::string replica = Plan().stages(1).replicas(0).worker_id();
  ReportLinkLost(Plan().stages(0).worker_id(), replica, 1);
  ASSERT_EQ(Plan().epoch(), 2u);
  EXPECT_EQ(Plan().stages(1).replicas_size(), 0);
  // It keeps heartbeating (its links may keep failing): not a replica again
  // for 30 s, then it is.
  for (int t = 0; t < 290; ++t) {
    clock_.AdvanceMs(100);
    for (const std::string& id : ids) Heartbeat(id, 0);
    controller_->Tick();
  }
  EXPECT_EQ(Plan().epoch(), 2u);
  for (int t = 0; t < 20; ++t) {
    clock_.AdvanceMs(100);
    for (const std::string& id : ids) Heartbeat(id, 0);
    controller_->Tick();
  }
  EXPECT_EQ(Plan().epoch(), 3u);
  ASSERT_EQ(Plan().stages(1).replicas_size(), 1);
  EXPECT_EQ(Plan().stages(1).replicas(0).worker_id(), replica);
}

TEST_F(ReplicaPlanTest, ASlowReplicatedStageSwapsItsSlowestWorkerForAStandby) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  ids.push_back(Join("e").worker_id());  // stage 0's replica
  const v1::Plan before = Plan();
  ASSERT_EQ(before.epoch(), 2u);
  ASSERT_EQ(before.stages(0).replicas_size(), 1);
  const std::string e = Join("f").worker_id();  // standby
  ids.push_back(e);
  const std::string slowest = before.stages(1).replicas(0).worker_id();
  std::set<std::string> stage1 = {before.stages(1).worker_id(), slowest};
  for (int t = 0; t < 70; ++t) {  // after 1 s, stage 1 is 5x the others; its replica the slowest
    clock_.AdvanceMs(100);
    for (const std::string& id : ids) {
      const double slowed = t < 10 ? 0.010 : id == slowest ? 0.055 : 0.050;
      Heartbeat(id, stage1.count(id) > 0 ? slowed : id == e ? 0 : 0.010);
    }
    controller_->Tick();
  }
  EXPECT_TRUE(HasEvent("straggler"));
  const v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), 3u);
  EXPECT_EQ(plan.stages(1).worker_id(), before.stages(1).worker_id());
  ASSERT_EQ(plan.stages(1).replicas_size(), 1);
  EXPECT_EQ(plan.stages(1).replicas(0).worker_id(), e);  // swapped in its place
}

TEST(ReplicaJobSpecTest, ReplicasNeedAnAsynchronousSchedule) {
  auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 3 } text {} "
                          "steps: 3 replicas: 2",
                          "test");
  ASSERT_FALSE(job.ok());
  EXPECT_NE(job.status().message().find("SCHEDULE_ASYNC_STASH"), std::string::npos)
      << job.status();
  EXPECT_FALSE(ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 3 } text {} "
                            "steps: 3 schedule: SCHEDULE_ASYNC_2BW replicas: 2",
                            "test")
                   .ok());
  const std::string async =
      "gpt { context: 8 d_model: 16 heads: 2 blocks: 3 } text {} steps: 3 "
      "schedule: SCHEDULE_ASYNC_STASH replicas: 2 ";
  EXPECT_TRUE(ParseJobSpec(async, "test").ok());
  job = ParseJobSpec(async + "replica_codec: CODEC_TOPK", "test");
  ASSERT_FALSE(job.ok());
  EXPECT_NE(job.status().message().find("TOPK"), std::string::npos) << job.status();
}

}  // namespace
}  // namespace geotrain
