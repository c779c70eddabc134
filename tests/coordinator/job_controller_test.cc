#include "coordinator/job_controller.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <set>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/model_profile.h"
#include "common/plan_util.h"
#include "common/rpc_options.h"
#include "coordinator/state_store.h"

namespace geotrain {
namespace {

// The state dir's files, with a hook before each write of the state and of
// the plan (a slow or failing disk).
class HookedStore : public CoordinatorStore {
 public:
  HookedStore(StateStore files, std::function<absl::Status()> before_state_write,
              std::function<absl::Status()> before_plan_write)
      : files_(std::move(files)),
        before_state_write_(std::move(before_state_write)),
        before_plan_write_(std::move(before_plan_write)) {}
  absl::Status WritePlan(const v1::Plan& plan) override {
    if (before_plan_write_) {
      if (absl::Status injected = before_plan_write_(); !injected.ok()) return injected;
    }
    return files_.WritePlan(plan);
  }
  absl::Status WriteState(const v1::CoordinatorState& state) override {
    if (before_state_write_) {
      if (absl::Status injected = before_state_write_(); !injected.ok()) return injected;
    }
    return files_.WriteState(state);
  }
  absl::StatusOr<std::optional<v1::Plan>> ReadPlan() const override { return files_.ReadPlan(); }
  absl::StatusOr<std::optional<v1::CoordinatorState>> ReadState() const override {
    return files_.ReadState();
  }
  std::string Describe() const override { return files_.Describe(); }

 private:
  StateStore files_;
  const std::function<absl::Status()> before_state_write_;
  const std::function<absl::Status()> before_plan_write_;
};

class JobControllerTest : public testing::Test {
 protected:
  void SetUp() override {
    Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
          "min_workers: 2 lease_ms: 1000");
  }

  // A fresh controller (and state dir) for the job `job_text`.
  void Start(const std::string& job_text) {
    controller_.reset();
    dir_ = testing::TempDir() + "/job_controller_" +
           testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    auto job = ParseJobSpec(job_text, "test");
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *job;
    JobControllerOptions options;
    options.job = *job;
    options.state_dir = dir_;
    options.metrics_log_path = dir_ + "/metrics.jsonl";
    options.clock = &clock_;
    options.authenticated_callers = authenticated_callers_;
    if (before_state_write_ || before_plan_write_) {
      absl::StatusOr<StateStore> files = StateStore::Open(dir_);
      ASSERT_TRUE(files.ok()) << files.status();
      options.store = std::make_shared<HookedStore>(*std::move(files), before_state_write_,
                                                    before_plan_write_);
    }
    options.before_log_write = before_log_write_;
    options.planner = planner_;
    auto controller = JobController::Create(options);
    ASSERT_TRUE(controller.ok()) << controller.status();
    controller_ = std::move(*controller);
  }

  // The coordinator dies and starts again on the same state directory.
  void Restart() {
    controller_.reset();
    JobControllerOptions options;
    options.job = job_;
    options.state_dir = dir_;
    options.metrics_log_path = dir_ + "/metrics.jsonl";
    options.clock = &clock_;
    options.authenticated_callers = authenticated_callers_;
    options.planner = planner_;
    auto controller = JobController::Create(options);
    ASSERT_TRUE(controller.ok()) << controller.status();
    controller_ = std::move(*controller);
  }

  v1::JoinResponse Join(const std::string& name) {
    v1::JoinRequest request;
    request.set_name(name);
    request.set_address(name + ":1");
    request.mutable_device()->set_matmul_gflops(10);
    absl::StatusOr<v1::JoinResponse> joined = controller_->Join(request);
    EXPECT_TRUE(joined.ok()) << joined.status();
    return joined.ok() ? *joined : v1::JoinResponse();
  }

  // Stage 0's heartbeat saying it has finished `step` of `epoch`: what
  // commits the last stage's reports of that step (ProgressGate).
  void FinishedOnStageZero(const std::string& worker, int step, uint64_t epoch = 1) {
    v1::HeartbeatRequest heartbeat;
    heartbeat.set_worker_id(worker);
    heartbeat.set_step(step);
    heartbeat.set_epoch(epoch);
    EXPECT_TRUE(controller_->Heartbeat(heartbeat));
  }

  // Steps 1..`steps` reported by the last stage `last` and finished by
  // stage 0's `first`, one clock millisecond apart.
  void TrainSteps(const std::string& first, const std::string& last, int steps,
                  uint64_t epoch = 1) {
    for (int step = 1; step <= steps; ++step) {
      v1::StepReport report;
      report.set_worker_id(last);
      report.set_epoch(epoch);
      report.set_step(step);
      report.set_loss(2.0);
      report.set_samples(8);
      ASSERT_TRUE(controller_->ReportStep(report).ok()) << step;
      FinishedOnStageZero(first, step, epoch);
      clock_.AdvanceMs(1);
    }
  }

  std::string ReadFile(const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  FakeClock clock_{0};
  bool authenticated_callers_ = false;
  std::function<absl::Status()> before_state_write_;
  std::function<absl::Status()> before_plan_write_;
  std::function<absl::Status(const std::string&)> before_log_write_;
  std::string planner_ = "join-order";
  v1::JobSpec job_;
  std::string dir_;
  std::unique_ptr<JobController> controller_;
};

TEST_F(JobControllerTest, PlansOnceEnoughWorkersJoined) {
  Join("a");
  controller_->FlushState();
  EXPECT_EQ(controller_->WaitForPlan(0, absl::ZeroDuration()), nullptr);
  EXPECT_EQ(controller_->Status().state(), "waiting");
  Join("b");
  PlanPublisher::PlanPtr plan = controller_->WaitForPlan(0, absl::Seconds(10));
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(plan->epoch(), 1u);
  ASSERT_EQ(plan->stages_size(), 2);
  EXPECT_EQ(plan->stages(0).address(), "a:1");
  EXPECT_EQ(plan->stages(1).layer_end(), 4);
  EXPECT_NE(ReadFile(dir_ + "/plan.textproto").find("epoch: 1"), std::string::npos);

  // A third worker is a standby.
  Join("c");
  v1::ClusterStatus status = controller_->Status();
  ASSERT_EQ(status.workers_size(), 3);
  EXPECT_EQ(status.workers(0).state(), v1::WORKER_STATE_TRAINING);
  EXPECT_EQ(status.workers(2).state(), v1::WORKER_STATE_STANDBY);
  EXPECT_EQ(status.workers(2).stage(), -1);
}

TEST_F(JobControllerTest, ReportsOfOtherEpochsOrOldStepsAreRefused) {
  v1::JoinResponse a = Join("a");
  v1::JoinResponse b = Join("b");  // the last stage: it reports the steps
  v1::StepReport report;
  report.set_worker_id(b.worker_id());
  report.set_epoch(7);
  report.set_step(1);
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kFailedPrecondition);
  report.set_epoch(1);
  report.set_loss(2.5);
  report.set_samples(64);
  EXPECT_TRUE(controller_->ReportStep(report).ok());
  EXPECT_EQ(controller_->Status().step(), 0) << "stage 0 has not finished step 1";
  FinishedOnStageZero(a.worker_id(), 1);
  EXPECT_EQ(controller_->Status().step(), 1);
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kFailedPrecondition);
  clock_.AdvanceMs(500);
  report.set_step(2);
  report.set_loss(2.0);
  EXPECT_TRUE(controller_->ReportStep(report).ok());
  FinishedOnStageZero(a.worker_id(), 2);
  v1::ClusterStatus status = controller_->Status();
  EXPECT_EQ(status.step(), 2);
  EXPECT_DOUBLE_EQ(status.loss(), 2.0);
  EXPECT_EQ(status.samples(), 128);
  EXPECT_NEAR(status.samples_per_s(), 128.0, 1e-6);
  controller_->FlushState();  // the logs are written off the caller's thread
  const std::string metrics = ReadFile(dir_ + "/metrics.jsonl");
  EXPECT_NE(metrics.find("{\"step\":1,\"loss\":2.5,\"samples\":64,\"time_s\":0.000"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("\"step\":2,\"loss\":2,\"samples\":128,\"time_s\":0.500"),
            std::string::npos)
      << metrics;
}

TEST_F(JobControllerTest, AStepReportNeverWaitsForASlowDisk) {
  // Once the plan is out, the disk stalls: every state write, and every
  // append to the events and metrics logs, waits until the test lets it go.
  absl::Notification disk_free;
  std::atomic<bool> stall{false};
  std::atomic<int> stalled_writes{0};
  std::atomic<int> stalled_events{0};
  std::atomic<int> stalled_metrics{0};
  before_state_write_ = [&]() -> absl::Status {
    if (!stall) return absl::OkStatus();
    ++stalled_writes;
    disk_free.WaitForNotification();
    return absl::OkStatus();
  };
  before_log_write_ = [&](const std::string& path) -> absl::Status {
    if (!stall) return absl::OkStatus();
    const std::string file = std::filesystem::path(path).filename().string();
    if (file == "events.log") ++stalled_events;
    if (file == "metrics.jsonl") ++stalled_metrics;
    disk_free.WaitForNotification();
    return absl::OkStatus();
  };
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 10 "
        "min_workers: 2 lease_ms: 1000");
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  stall = true;
  v1::StepReport report;
  report.set_worker_id(b);
  report.set_epoch(1);
  report.set_samples(8);
  report.set_loss(2.5);
  report.set_step(1);
  ASSERT_TRUE(controller_->ReportStep(report).ok());
  FinishedOnStageZero(a, 1);
  // An event while the disk is stuck: a third worker joins (a standby).
  const absl::Time join_start = absl::Now();
  Join("c");
  EXPECT_LT(absl::Now() - join_start, absl::Seconds(5));
  // That report's state write, its metrics line and the join's event are
  // now stuck, each on its own file's writer.
  for (int i = 0; i < 1000 && (stalled_writes == 0 || stalled_events == 0 ||
                               stalled_metrics == 0); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GE(stalled_writes.load(), 1);
  ASSERT_GE(stalled_events.load(), 1);
  ASSERT_GE(stalled_metrics.load(), 1);
  const absl::Time start = absl::Now();
  for (int step = 2; step <= 3; ++step) {
    report.set_step(step);
    ASSERT_TRUE(controller_->ReportStep(report).ok());
    FinishedOnStageZero(a, step);
  }
  // Returned while the disk was still stuck (a wait would never end).
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(controller_->Status().step(), 3);
  disk_free.Notify();
  controller_->FlushState();
  EXPECT_NE(ReadFile(dir_ + "/state.textproto").find("step: 3"), std::string::npos);
  EXPECT_NE(ReadFile(dir_ + "/metrics.jsonl").find("\"step\":3,"), std::string::npos);
  const std::string events = ReadFile(dir_ + "/events.log");
  EXPECT_NE(events.find("\"kind\":\"planned\""), std::string::npos);
  EXPECT_NE(events.find("\"kind\":\"joined\",\"worker\":\"c\""), std::string::npos);
}

TEST_F(JobControllerTest, AStalledStoreHoldsBackThePlanAndNothingElse) {
  // The store stalls during a plan's publication: heartbeats, step reports
  // and status keep returning, and the workers see the plan only once it
  // is durable.
  std::atomic<bool> stall{false};
  std::atomic<int> stalled_plans{0};
  absl::Notification store_free;
  before_plan_write_ = [&]() -> absl::Status {
    if (!stall) return absl::OkStatus();
    ++stalled_plans;
    store_free.WaitForNotification();
    return absl::OkStatus();
  };
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 100 "
        "min_workers: 2 lease_ms: 1000");
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  TrainSteps(a, b, 2);
  ASSERT_NE(controller_->WaitForPlan(0, absl::Seconds(10)), nullptr);
  stall = true;
  // A third worker joins and the second leaves: epoch 2 moves stage 1 to
  // the third, and its write is stuck.
  const std::string c = Join("c").worker_id();
  controller_->Leave(b);
  for (int i = 0; i < 2000 && stalled_plans == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(stalled_plans.load(), 1);
  const absl::Time start = absl::Now();
  for (int i = 0; i < 20; ++i) {
    v1::HeartbeatRequest heartbeat;
    heartbeat.set_worker_id(i % 2 == 0 ? a : c);
    EXPECT_TRUE(controller_->Heartbeat(heartbeat));
  }
  // The controller acts on epoch 2 already: the last stage's report of
  // step 3 counts once stage 0 has finished it.
  v1::StepReport report;
  report.set_worker_id(c);
  report.set_epoch(2);
  report.set_step(3);
  report.set_loss(2.0);
  report.set_samples(8);
  EXPECT_TRUE(controller_->ReportStep(report).ok());
  FinishedOnStageZero(a, 3, 2);
  const v1::ClusterStatus status = controller_->Status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // a wait would never end
  EXPECT_EQ(status.epoch(), 2u);
  EXPECT_EQ(status.step(), 3);
  // Not visible, and not on disk, while the store is stuck.
  EXPECT_EQ(controller_->WaitForPlan(1, absl::Milliseconds(50)), nullptr);
  EXPECT_EQ(ReadFile(dir_ + "/plan.textproto").find("epoch: 2"), std::string::npos);
  store_free.Notify();
  PlanPublisher::PlanPtr plan = controller_->WaitForPlan(1, absl::Seconds(10));
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(plan->epoch(), 2u);
  EXPECT_NE(ReadFile(dir_ + "/plan.textproto").find("epoch: 2"), std::string::npos);
}

TEST_F(JobControllerTest, ARetriedJoinIsOneMemberAndAnAbandonedOneNone) {
  v1::JoinRequest request;
  request.set_name("a");
  request.set_address("a:1");
  request.set_session_id("0123abcd");
  request.mutable_device()->set_matmul_gflops(10);
  absl::StatusOr<v1::JoinResponse> first = controller_->Join(request);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<v1::JoinResponse> retry = controller_->Join(request);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->worker_id(), first->worker_id());
  EXPECT_EQ(retry->job().steps(), 3);
  v1::ClusterStatus status = controller_->Status();
  EXPECT_EQ(status.workers_size(), 1);
  int joined = 0;
  for (const v1::Event& e : status.events()) joined += e.kind() == "joined";
  EXPECT_EQ(joined, 1);
  // Another process whose caller gave up: it leaves nothing behind.
  request.set_name("b");
  request.set_address("b:1");
  request.set_session_id("4567ef");
  absl::StatusOr<v1::JoinResponse> abandoned = controller_->Join(request);
  ASSERT_TRUE(abandoned.ok());
  // Two members: min_workers is met and the plan names b, so it stays.
  controller_->AbandonJoin(abandoned->worker_id(), "4567ef");
  EXPECT_TRUE(controller_->KnowsWorker(abandoned->worker_id()));
  request.set_name("c");
  request.set_address("c:1");
  request.set_session_id("89");
  absl::StatusOr<v1::JoinResponse> spare = controller_->Join(request);
  ASSERT_TRUE(spare.ok());
  controller_->AbandonJoin(spare->worker_id(), "89");
  EXPECT_FALSE(controller_->KnowsWorker(spare->worker_id()));
  EXPECT_EQ(controller_->Status().workers_size(), 2);
  request.set_session_id(std::string(65, 'x'));
  EXPECT_EQ(controller_->Join(request).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(JobControllerTest, AFailedStateWriteIsRetriedWithTheNextState) {
  std::atomic<bool> fail{true};
  before_state_write_ = [&]() -> absl::Status {
    return fail ? absl::UnavailableError("disk full (injected)") : absl::OkStatus();
  };
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
        "min_workers: 2 lease_ms: 1000");
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  v1::StepReport report;
  report.set_worker_id(b);
  report.set_epoch(1);
  report.set_samples(8);
  report.set_step(1);
  ASSERT_TRUE(controller_->ReportStep(report).ok());
  FinishedOnStageZero(a, 1);
  controller_->FlushState();
  EXPECT_EQ(ReadFile(dir_ + "/state.textproto").find("step: 1"), std::string::npos);
  fail = false;
  report.set_step(2);
  ASSERT_TRUE(controller_->ReportStep(report).ok());
  FinishedOnStageZero(a, 2);
  controller_->FlushState();
  EXPECT_NE(ReadFile(dir_ + "/state.textproto").find("step: 2"), std::string::npos);
}

TEST_F(JobControllerTest, HeartbeatsCarryMeasureTasksAndTheAnswersFillTheMatrix) {
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  v1::HeartbeatRequest request;
  request.set_worker_id(a);
  v1::HeartbeatResponse response;
  ASSERT_TRUE(controller_->Heartbeat(request, &response));
  const v1::ProbeTask* measure = nullptr;
  for (const v1::ProbeTask& task : response.probes()) {
    if (task.measure_bytes() > 0) measure = &task;
  }
  ASSERT_NE(measure, nullptr);
  EXPECT_EQ(measure->worker_id(), b);
  EXPECT_EQ(measure->address(), "b:1");
  EXPECT_LE(measure->measure_bytes(), 1u << 20);
  v1::ProbeResult* result = request.add_probe_results();
  result->set_worker_id(b);
  result->set_measured(true);
  result->set_reachable(true);
  result->set_rtt_s(0.030);
  result->set_rate_bps(4e7);
  // b reports its link to a: what it sends arrives at 9 Mb/s.
  v1::LinkStats* link = request.mutable_stats()->add_links();
  link->set_peer("a:1");
  link->set_link_rate_bps(9e6);
  ASSERT_TRUE(controller_->Heartbeat(request, nullptr));
  v1::HeartbeatRequest from_b;
  from_b.set_worker_id(b);
  *from_b.mutable_stats() = request.stats();
  ASSERT_TRUE(controller_->Heartbeat(from_b, nullptr));
  const v1::ClusterStatus status = controller_->Status();
  ASSERT_EQ(status.network_size(), 2);
  for (const v1::NetworkLink& l : status.network()) {
    if (l.from_worker() == a) {
      EXPECT_EQ(l.to_worker(), b);
      EXPECT_DOUBLE_EQ(l.rtt_s(), 0.030);
      EXPECT_DOUBLE_EQ(l.rate_bps(), 4e7);
      EXPECT_EQ(l.source(), "probe");
    } else {
      EXPECT_EQ(l.from_worker(), b);
      EXPECT_EQ(l.to_worker(), a);
      EXPECT_DOUBLE_EQ(l.rate_bps(), 9e6);
      EXPECT_EQ(l.source(), "link");
    }
  }
}

TEST_F(JobControllerTest, EvalIsLogged) {
  Join("a");
  v1::JoinResponse b = Join("b");
  v1::EvalReport eval;
  eval.set_worker_id(b.worker_id());
  eval.set_epoch(1);
  eval.set_step(3);
  eval.set_val_loss(1.5);
  eval.set_has_accuracy(true);
  eval.set_accuracy(0.875);
  ASSERT_TRUE(controller_->ReportEval(eval).ok());
  controller_->FlushState();  // the logs are written off the caller's thread
  EXPECT_NE(ReadFile(dir_ + "/metrics.jsonl")
                .find("{\"eval\":true,\"step\":3,\"val_loss\":1.5,\"samples\":0,\"accuracy\":0.875000"),
            std::string::npos);
}

TEST_F(JobControllerTest, JobEndsWhenEveryStageIsDone) {
  v1::JoinResponse a = Join("a");
  v1::JoinResponse b = Join("b");
  v1::DoneReport done;
  done.set_worker_id(a.worker_id());
  EXPECT_EQ(controller_->ReportDone(done).code(), absl::StatusCode::kFailedPrecondition)
      << "no step is done yet";
  TrainSteps(a.worker_id(), b.worker_id(), 3);
  ASSERT_TRUE(controller_->ReportDone(done).ok());
  EXPECT_FALSE(controller_->done());
  done.set_worker_id("w42");
  EXPECT_EQ(controller_->ReportDone(done).code(), absl::StatusCode::kPermissionDenied);
  done.set_worker_id(b.worker_id());
  ASSERT_TRUE(controller_->ReportDone(done).ok());
  EXPECT_TRUE(controller_->done());
  PlanPublisher::PlanPtr final_plan = controller_->WaitForPlan(1, absl::Seconds(10));
  ASSERT_NE(final_plan, nullptr);
  EXPECT_TRUE(final_plan->job_done());
  EXPECT_EQ(final_plan->epoch(), 2u);
  EXPECT_EQ(controller_->Status().state(), "done");
}

TEST_F(JobControllerTest, SilentWorkerIsLost) {
  Join("a");
  clock_.AdvanceMs(1500);
  controller_->Tick();
  v1::ClusterStatus status = controller_->Status();
  EXPECT_EQ(status.workers(0).state(), v1::WORKER_STATE_DEAD);
  bool lost_event = false;
  for (const v1::Event& e : status.events()) lost_event |= e.kind() == "lost";
  EXPECT_TRUE(lost_event);
  controller_->FlushState();  // the logs are written off the caller's thread
  EXPECT_NE(ReadFile(dir_ + "/events.log").find("\"kind\":\"lost\""), std::string::npos);
}

TEST(JobControllerCreateTest, UnwritableStateDirIsAnError) {
  FakeClock clock;
  JobControllerOptions options;
  options.state_dir = "/proc/geotrain-cannot-exist";
  options.clock = &clock;
  EXPECT_FALSE(JobController::Create(options).ok());
}

// Re-planning decisions, driven by hand: lease loss with and without a
// standby, a lost link, a straggler, and recovery from the state dir.
class ReplanTest : public JobControllerTest {
 protected:
  void Heartbeat(const std::string& id, double compute_s) {
    v1::HeartbeatRequest request;
    request.set_worker_id(id);
    request.mutable_stats()->set_compute_s_per_microbatch(compute_s);
    controller_->Heartbeat(request);
  }
  // The newest plan decided, once visible.
  v1::Plan Plan() {
    controller_->FlushState();
    return *controller_->WaitForPlan(0, absl::ZeroDuration());
  }
  // `reporter` says its link to `peer` broke while running `epoch`.
  absl::Status ReportLinkLost(const std::string& reporter, const std::string& peer,
                              uint64_t epoch) {
    v1::WorkerEvent lost;
    lost.set_kind("link_lost");
    lost.set_worker_id(reporter);
    lost.set_peer(peer);
    lost.set_epoch(epoch);
    return controller_->RecordWorkerEvent(lost);
  }
  bool HasEvent(const std::string& kind) {
    const v1::ClusterStatus status = controller_->Status();
    for (const v1::Event& e : status.events()) {
      if (e.kind() == kind) return true;
    }
    return false;
  }
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

TEST_F(ReplanTest, TheFirstLostLinkOfAnEpochCounts) {
  const std::string a = Join("a").worker_id(), b = Join("b").worker_id();
  const std::string c = Join("c").worker_id();
  ReportLinkLost(a, b, 1);
  EXPECT_EQ(Plan().epoch(), 2u);
  EXPECT_EQ(Plan().stages(1).worker_id(), c);
  // b's report about a (same broken link, old epoch) changes nothing.
  ReportLinkLost(b, a, 1);
  EXPECT_EQ(Plan().epoch(), 2u);
  EXPECT_EQ(Plan().stages(0).worker_id(), a);
}

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

TEST_F(ReplanTest, ADrainingWorkerIsNotAccusedOfItsClosedLinks) {
  const std::string a = Join("a").worker_id(), b = Join("b").worker_id();
  Join("c");
  v1::WorkerEvent draining;
  draining.set_kind("draining");
  draining.set_worker_id(b);
  controller_->RecordWorkerEvent(draining);
  ReportLinkLost(a, b, 1);
  EXPECT_EQ(Plan().epoch(), 1u);  // b's stage waits for its checkpoint
  controller_->Leave(b);           // saved: now it moves
  EXPECT_EQ(Plan().epoch(), 2u);
  EXPECT_NE(Plan().stages(1).worker_id(), b);
}

TEST_F(ReplanTest, AStragglerIsReplacedByAStandby) {
  const std::string a = Join("a").worker_id(), b = Join("b").worker_id();
  const std::string c = Join("c").worker_id();
  ASSERT_EQ(Plan().epoch(), 1u);
  // b keeps pace with a for 1 s, then takes 5x as long per microbatch, for 6 s.
  const double a_s = 0.010, b_s = 0.050;
  for (int t = 0; t < 70; ++t) {
    clock_.AdvanceMs(100);
    Heartbeat(a, a_s);
    Heartbeat(b, t < 10 ? a_s : b_s);
    Heartbeat(c, 0);
    controller_->Tick();
  }
  EXPECT_TRUE(HasEvent("straggler"));
  EXPECT_EQ(Plan().epoch(), 2u);
  EXPECT_EQ(Plan().stages(1).worker_id(), c);
}

TEST_F(ReplanTest, AStageSlowFromTheStartIsNoStraggler) {
  // The plan gave b's stage 5x the work (say, its benchmark at join was
  // taken while the machine was busy): slow by design, not falling behind.
  const std::string a = Join("a").worker_id(), b = Join("b").worker_id();
  const std::string c = Join("c").worker_id();
  for (int t = 0; t < 100; ++t) {
    clock_.AdvanceMs(100);
    Heartbeat(a, 0.010);
    Heartbeat(b, 0.050);
    Heartbeat(c, 0);
    controller_->Tick();
  }
  EXPECT_FALSE(HasEvent("straggler"));
  EXPECT_EQ(Plan().epoch(), 1u);
}

TEST_F(ReplanTest, ModeratelySlowerStagesAreNoStragglers) {
  const std::string a = Join("a").worker_id(), b = Join("b").worker_id();
  Join("c");
  const double a_s = 0.010, b_s = 0.025;  // 2.5x: within the factor of 3
  for (int t = 0; t < 100; ++t) {
    clock_.AdvanceMs(100);
    Heartbeat(a, a_s);
    Heartbeat(b, b_s);
    controller_->Tick();
  }
  EXPECT_FALSE(HasEvent("straggler"));
  EXPECT_EQ(Plan().epoch(), 1u);
}

TEST_F(ReplanTest, ARestartedControllerRecoversFromTheStateDir) {
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  v1::StepReport report;
  report.set_worker_id(b);
  report.set_epoch(1);
  report.set_step(1);
  report.set_samples(8);
  ASSERT_TRUE(controller_->ReportStep(report).ok());
  FinishedOnStageZero(a, 1);
  controller_.reset();  // the coordinator dies

  JobControllerOptions options;
  options.job = *ParseJobSpec(
      "gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
      "min_workers: 2 lease_ms: 1000",
      "test");
  options.state_dir = dir_;
  options.metrics_log_path = dir_ + "/metrics.jsonl";
  options.clock = &clock_;
  controller_ = *JobController::Create(options);
  const v1::ClusterStatus status = controller_->Status();
  EXPECT_EQ(status.epoch(), 1u);
  EXPECT_EQ(status.step(), 1);
  EXPECT_EQ(status.workers_size(), 2);
  EXPECT_EQ(status.workers(0).state(), v1::WORKER_STATE_TRAINING);
  EXPECT_TRUE(HasEvent("recovered"));
  // The same step is refused; the next one is taken.
  EXPECT_FALSE(controller_->ReportStep(report).ok());
  report.set_step(2);
  EXPECT_TRUE(controller_->ReportStep(report).ok());
  FinishedOnStageZero(a, 2);
  EXPECT_EQ(controller_->Status().step(), 2);
  // The metrics log was continued, not truncated.
  controller_->FlushState();  // the logs are written off the caller's thread
  EXPECT_NE(ReadFile(dir_ + "/metrics.jsonl").find("\"step\":1,"), std::string::npos);
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

namespace geotrain {
namespace {

// What a hostile (or broken) worker may say, each refused with the
// controller still working; regressions of the attacks in issue 11.
class HostileInputTest : public ReplanTest {
 protected:
  // A checkpoint of `layer` that fits the model: its parameters' shapes in
  // order, each followed by `state_per_param` optimizer tensors, all zero.
  v1::LayerCheckpoint FittingCheckpoint(const std::string& worker, int layer, int step,
                                        int state_per_param = 0) {
    v1::LayerCheckpoint c;
    c.set_worker_id(worker);
    c.set_layer(layer);
    c.set_step(step);
    c.set_state_per_param(state_per_param);
    uint64_t bytes = 0;
    auto fill = [&bytes](v1::TensorHeader* h, const std::vector<int64_t>& shape) {
      h->set_dtype(v1::DTYPE_FLOAT32);
      h->set_codec(v1::CODEC_NONE);
      uint64_t n = 1;
      for (int64_t dim : shape) {
        h->add_shape(dim);
        n *= static_cast<uint64_t>(dim);
      }
      h->set_payload_bytes(4 * n);
      h->set_encoded_bytes(4 * n);
      bytes += 4 * n;
    };
    const std::vector<ParameterSpec> params = LayerParameters(job_, layer);
    for (const ParameterSpec& p : params) fill(c.add_params(), p.shape);
    for (const ParameterSpec& p : params) {
      for (int k = 0; k < state_per_param; ++k) fill(c.add_optimizer_state(), p.shape);
    }
    c.mutable_payload()->assign(bytes, '\0');
    return c;
  }
};

TEST_F(HostileInputTest, StepReportsOutOfRangeAreRefusedAndRealOnesStillCount) {
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  v1::StepReport report;
  report.set_worker_id(b);
  report.set_epoch(1);
  report.set_samples(64);
  report.set_step(1000000000);
  report.set_loss(std::nan(""));
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kInvalidArgument);
  report.set_step(1);
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kInvalidArgument)
      << "a NaN loss";
  report.set_loss(2.5);
  report.set_samples(1 << 30);
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kInvalidArgument);
  report.set_samples(64);
  report.set_worker_id(a);  // stage 0 vouches for the step; it does not own the loss
  EXPECT_TRUE(controller_->ReportStep(report).ok());
  EXPECT_EQ(controller_->Status().step(), 0);
  report.set_worker_id(b);
  ASSERT_TRUE(controller_->ReportStep(report).ok());
  EXPECT_EQ(controller_->Status().step(), 1);
  controller_->FlushState();  // the logs are written off the caller's thread
  EXPECT_EQ(ReadFile(dir_ + "/metrics.jsonl").find("nan"), std::string::npos);
  v1::EvalReport eval;
  eval.set_worker_id(b);
  eval.set_epoch(1);
  eval.set_step(1);
  eval.set_val_loss(std::numeric_limits<double>::infinity());
  EXPECT_EQ(controller_->ReportEval(eval).code(), absl::StatusCode::kInvalidArgument);
  v1::DoneReport done;
  done.set_worker_id(b);
  done.set_step(1 << 30);
  EXPECT_EQ(controller_->ReportDone(done).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(HostileInputTest, JoinsOutOfRangeAreRefusedAndPlanningGoesOn) {
  auto join = [this](const std::string& name, const std::string& address, double gflops) {
    v1::JoinRequest request;
    request.set_name(name);
    request.set_address(address);
    request.mutable_device()->set_matmul_gflops(gflops);
    return controller_->Join(request).status();
  };
  EXPECT_EQ(join("nan", "h:1", std::nan("")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(join("inf", "h:1", std::numeric_limits<double>::infinity()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(join("zero", "h:1", 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(join(std::string(1 << 20, 'x'), "h:1", 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(join("ctrl\n", "h:1", 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(join("port", "h:99999", 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(join("noport", "h", 1).code(), absl::StatusCode::kInvalidArgument);
  // Addresses are parsed strictly (issue 32: "[::1" was accepted).
  for (const char* address : {"[::1", "[::1:7000", "::1:7000", "[::1]]:7000", "[zz]:7000",
                              "h:+80", "h:0080x", "h.:80", "a..b:80", "h/x:80", ":80",
                              "h :80", "[]:80"}) {
    EXPECT_EQ(join("addr", address, 1).code(), absl::StatusCode::kInvalidArgument) << address;
  }
  for (const char* address : {"[::1]:7000", "198.51.100.7:65535", "worker-3.example.org:1"}) {
    EXPECT_TRUE(CheckHostPort(address).ok()) << address;
  }
  // NaN anywhere in a join or a heartbeat is refused (issue 32: one join's
  // NaN benchmark kept the job from ever being planned).
  v1::HeartbeatRequest heartbeat;
  (*heartbeat.mutable_layer_seconds_per_sample())["block"] = std::nan("");
  absl::Status refused = ValidateHeartbeatRequest(heartbeat);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("layer_seconds_per_sample"), std::string::npos) << refused;
  heartbeat.clear_layer_seconds_per_sample();
  heartbeat.add_probe_results()->set_rtt_s(std::numeric_limits<double>::infinity());
  EXPECT_EQ(ValidateHeartbeatRequest(heartbeat).code(), absl::StatusCode::kInvalidArgument);
  heartbeat.clear_probe_results();
  heartbeat.mutable_stats()->add_links()->set_link_rate_bps(std::nan(""));
  EXPECT_EQ(ValidateHeartbeatRequest(heartbeat).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(controller_->Status().workers_size(), 0);
  const std::string a = Join("a").worker_id();
  heartbeat.set_worker_id(a);
  (*heartbeat.mutable_layer_seconds_per_sample())["block"] = std::nan("");
  EXPECT_FALSE(controller_->Heartbeat(heartbeat)) << "nothing of it is kept";
  Join("b");
  EXPECT_EQ(Plan().stages_size(), 2);
}

TEST_F(HostileInputTest, LinkReportsCountFromNeighboursOncePerLinkAndEpoch) {
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  const std::string c = Join("c").worker_id();  // standby
  const std::string d = Join("d").worker_id();  // standby
  EXPECT_EQ(ReportLinkLost(a, c, 1).code(), absl::StatusCode::kPermissionDenied)
      << "c is not in the plan";
  EXPECT_EQ(ReportLinkLost(a, a, 1).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Plan().epoch(), 1u);
  EXPECT_TRUE(HasEvent("accusation_refused"));
  ASSERT_TRUE(ReportLinkLost(a, b, 1).ok());
  const v1::Plan second = Plan();
  ASSERT_EQ(second.epoch(), 2u);
  const std::string replacement = second.stages(1).worker_id();
  EXPECT_NE(replacement, b);
  // The other end's report of the same break changes nothing.
  ASSERT_TRUE(ReportLinkLost(b, a, 1).ok());
  EXPECT_EQ(Plan().epoch(), 2u);
  // A second break of a's, at once (issue 32: it was refused as "one
  // accusation per worker per lease", and the stage waited for a plan that
  // never came). Now a is in two broken links, its neighbour in one: a
  // leaves, and the standby takes stage 0.
  ASSERT_TRUE(ReportLinkLost(a, replacement, 2).ok());
  const v1::Plan third = Plan();
  EXPECT_EQ(third.epoch(), 3u);
  EXPECT_EQ(third.stages(0).worker_id(), d);
  EXPECT_EQ(third.stages(1).worker_id(), replacement);
  ASSERT_TRUE(ReportLinkLost(a, replacement, 2).ok());
  EXPECT_EQ(Plan().epoch(), 3u) << "an old epoch's report changes nothing";
}

TEST_F(HostileInputTest, AWorkerInRepeatedBrokenLinksIsExcludedWhoeverReports) {
  authenticated_callers_ = true;
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
        "min_workers: 2 lease_ms: 1000");
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  const std::string liar = Plan().stages(0).worker_id();
  // It accuses its honest neighbour twice; the first is taken out (the
  // record is even), then the liar is.
  const v1::Plan first = Plan();
  ASSERT_TRUE(ReportLinkLost(liar, first.stages(1).worker_id(), first.epoch()).ok());
  const v1::Plan second = Plan();
  ASSERT_EQ(second.stages(0).worker_id(), liar);
  ASSERT_TRUE(ReportLinkLost(liar, second.stages(1).worker_id(), second.epoch()).ok());
  const v1::Plan third = Plan();
  EXPECT_NE(third.stages(0).worker_id(), liar);
  EXPECT_NE(third.stages(1).worker_id(), liar);
  EXPECT_TRUE(HasEvent("excluded"));
  // Excluded, it is no standby: heartbeats do not bring it back.
  for (int t = 0; t < 20; ++t) {
    clock_.AdvanceMs(100);
    for (const std::string& id : ids) Heartbeat(id, 0);
    controller_->Tick();
  }
  bool shown = false;
  const v1::ClusterStatus status = controller_->Status();
  for (const v1::WorkerStatus& w : status.workers()) {
    if (w.id() == liar) {
      shown = !w.suspected().empty();
      EXPECT_EQ(w.stage(), -1);
    }
  }
  EXPECT_TRUE(shown) << "the exclusion is in status";
}

TEST_F(HostileInputTest, WithoutAStandbyAnExcludedWorkersLayersGoToTheOthers) {
  authenticated_callers_ = true;
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3 "
        "min_workers: 2 lease_ms: 1000");
  const std::string liar = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  const std::string c = Join("c").worker_id();  // the only standby
  ASSERT_TRUE(ReportLinkLost(liar, b, 1).ok());
  ASSERT_EQ(Plan().stages(1).worker_id(), c);
  ASSERT_TRUE(ReportLinkLost(liar, c, 2).ok());
  // b was taken out a moment ago and has not heartbeated since: no standby.
  const v1::Plan plan = Plan();
  ASSERT_EQ(plan.stages_size(), 1) << "re-partitioned over the one worker left";
  EXPECT_EQ(plan.stages(0).worker_id(), c);
  EXPECT_EQ(plan.stages(0).layer_begin(), 0);
  EXPECT_EQ(plan.stages(0).layer_end(), 4);
}

TEST_F(HostileInputTest, DeadMembersArePrunedAndStatusStaysSmall) {
  Join("a");
  Join("b");
  for (int i = 0; i < 400; ++i) {
    const std::string id = Join(std::string(128, 'n')).worker_id();
    controller_->Leave(id);
  }
  const v1::ClusterStatus status = controller_->Status();
  EXPECT_LE(status.workers_size(), 2 + 256);
  EXPECT_LT(status.ByteSizeLong(), 1u << 20);
  // Ids of forgotten workers are not given out again.
  const std::string next = Join("z").worker_id();
  EXPECT_EQ(next, "w402");
}

}  // namespace
}  // namespace geotrain

namespace geotrain {
namespace {

// The network planner online: fresh figures, a better plan, a decision.
class VoluntaryReplanTest : public HostileInputTest {
 protected:
  void SetUp() override {
    planner_ = "network";
    Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 1000 "
          "min_workers: 3 lease_ms: 1000000 checkpoint_every: 1");
  }
  void ReportTimings(const std::string& id) {
    v1::HeartbeatRequest request;
    request.set_worker_id(id);
    (*request.mutable_layer_seconds_per_sample())["embed"] = 1e-4;
    (*request.mutable_layer_seconds_per_sample())["block"] = 1e-3;
    (*request.mutable_layer_seconds_per_sample())["head"] = 1e-3;
    controller_->Heartbeat(request);
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
};

TEST_F(NetworkPipelinesTest, AnOuterJobIsPlannedAsPipelinesWhereTheyPay) {
  std::vector<std::string> ids;
  for (const char* name : {"a", "b", "c", "d"}) ids.push_back(Join(name).worker_id());
  for (const std::string& id : ids) ReportTimings(id);
  AnswerMeasureTasks(ids, {});
  controller_->Tick();
  ASSERT_EQ(controller_->Status().state(), "training");
  const v1::Plan plan = Plan();
  EXPECT_GE(plan.pipelines(), 2) << plan.DebugString();
  const v1::ClusterStatus status = controller_->Status();
  EXPECT_EQ(status.pipelines(), plan.pipelines());
  EXPECT_EQ(status.prediction().planner(), "network");
  EXPECT_FALSE(status.prediction().exact());
  EXPECT_NE(status.prediction().explanation().find("pipeline 1:"), std::string::npos)
      << status.prediction().explanation();
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
  for (const v1::StageAssignment& stage : first.stages()) {
    for (int l = stage.layer_begin(); l < stage.layer_end(); ++l) {
      ASSERT_TRUE(controller_->checkpoint_gate().Save(FittingCheckpoint(stage.worker_id(), l, 0)).ok());
    }
  }
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

namespace geotrain {
namespace {

// Issue 32: what one certified worker may claim about progress, and what
// becomes of a worker whose word is no longer trusted.
class ProgressClaimTest : public HostileInputTest {
 protected:
  void SetUp() override {
    Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 3000 "
          "min_workers: 2 lease_ms: 1000");
    first_ = Join("a").worker_id();
    last_ = Join("b").worker_id();
  }
  absl::Status Claim(int step, double loss = 2.0) {
    v1::StepReport report;
    report.set_worker_id(last_);
    report.set_epoch(Plan().epoch());
    report.set_step(step);
    report.set_loss(loss);
    report.set_samples(8);
    return controller_->ReportStep(report);
  }
  std::string first_, last_;
};

TEST_F(ProgressClaimTest, AJumpToTheLastStepIsRefusedAndSuspected) {
  TrainSteps(first_, last_, 104);
  EXPECT_EQ(controller_->Status().step(), 104);
  const absl::Status jump = Claim(3000, 0.01);
  EXPECT_EQ(jump.code(), absl::StatusCode::kFailedPrecondition) << jump;
  EXPECT_TRUE(HasEvent("suspected"));
  EXPECT_EQ(controller_->Status().step(), 104);
  // A restarted coordinator resumes where the pipeline really is, and the
  // honest reports that follow count.
  controller_->FlushState();
  EXPECT_EQ(ReadFile(dir_ + "/state.textproto").find("step: 3000"), std::string::npos);
  ASSERT_TRUE(Claim(105).ok());
  FinishedOnStageZero(first_, 105);
  EXPECT_EQ(controller_->Status().step(), 105);
}

TEST_F(ProgressClaimTest, NeitherEndAloneMovesProgress) {
  // The last stage alone: its claims wait for stage 0.
  for (int step = 1; step <= 10; ++step) ASSERT_TRUE(Claim(step).ok());
  EXPECT_EQ(controller_->Status().step(), 0);
  // Stage 0 alone: it vouches for steps nobody claimed; nothing past the
  // claims commits.
  FinishedOnStageZero(first_, 2999);
  EXPECT_EQ(controller_->Status().step(), 10);
  // A claim twice is refused.
  EXPECT_EQ(Claim(10).code(), absl::StatusCode::kFailedPrecondition);
  // Nor can any other worker speak for either end.
  const std::string c = Join("c").worker_id();  // a standby
  FinishedOnStageZero(c, 2999);
  v1::StepReport report;
  report.set_worker_id(c);
  report.set_epoch(1);
  report.set_step(11);
  report.set_samples(8);
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(controller_->Status().step(), 10);
}

TEST_F(ProgressClaimTest, DoneBeforeTheLastStepEndsNothing) {
  TrainSteps(first_, last_, 1);
  v1::DoneReport done;
  done.set_step(3000);
  for (const std::string& id : {first_, last_}) {
    done.set_worker_id(id);
    EXPECT_EQ(controller_->ReportDone(done).code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_FALSE(controller_->done());
  EXPECT_TRUE(HasEvent("suspected"));
  controller_->FlushState();
  EXPECT_EQ(controller_->WaitForPlan(1, absl::ZeroDuration()), nullptr)
      << "no final plan was published";
}

TEST_F(ProgressClaimTest, AWorkerWhoseLeaseRanOutIsOut) {
  TrainSteps(first_, last_, 2);
  clock_.AdvanceMs(1500);  // no heartbeat from `last_`; Tick has not run yet
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_worker_id(last_);
  EXPECT_FALSE(controller_->Heartbeat(heartbeat)) << "a lapsed lease is not renewed";
  EXPECT_EQ(Claim(3).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(controller_->checkpoint_gate().Save(FittingCheckpoint(last_, 3, 2)).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(ProgressClaimTest, ARevokedWorkersCheckpointsAreQuarantined) {
  // `last_` uploads honest checkpoints, then (a worker turned bad) a
  // scaled one at the newest step; a standby `c` takes over after the revoke.
  const std::string c = Join("c").worker_id();
  TrainSteps(first_, last_, 20);
  const int layer = Plan().stages(1).layer_begin();
  ASSERT_TRUE(controller_->checkpoint_gate().Save(FittingCheckpoint(last_, layer, 10)).ok());
  v1::LayerCheckpoint poisoned = FittingCheckpoint(last_, layer, 20);
  const float scaled = -8.0f;
  for (size_t i = 0; i < poisoned.payload().size(); i += 4) {
    std::memcpy(poisoned.mutable_payload()->data() + i, &scaled, 4);
  }
  ASSERT_TRUE(controller_->checkpoint_gate().Save(poisoned).ok());
  EXPECT_EQ(controller_->checkpoint_gate().Load(last_, layer)->step(), 20);
  EXPECT_TRUE(controller_->RevokeWorker(last_));
  EXPECT_TRUE(HasEvent("checkpoints_quarantined"));
  const v1::Plan plan = Plan();
  ASSERT_EQ(plan.stages(1).worker_id(), c) << "the standby took the stage";
  absl::StatusOr<v1::LayerCheckpoint> restored = controller_->checkpoint_gate().Load(c, layer);
  EXPECT_EQ(restored.status().code(), absl::StatusCode::kNotFound)
      << "every checkpoint of the layer came from the revoked worker";
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/checkpoints/quarantine"));
}

TEST_F(ProgressClaimTest, ARestoreFallsBackToTheNewestTrustedCheckpoint) {
  const std::string c = Join("c").worker_id();  // a standby
  TrainSteps(first_, last_, 20);
  const int layer = Plan().stages(1).layer_begin();
  ASSERT_TRUE(controller_->checkpoint_gate().Save(FittingCheckpoint(last_, layer, 10)).ok());
  // The stage moves to `c`, which uploads every weight scaled by -8 (finite)
  // at the newest step it may.
  ASSERT_TRUE(ReportLinkLost(first_, last_, 1).ok());
  ASSERT_EQ(Plan().stages(1).worker_id(), c);
  v1::LayerCheckpoint poisoned = FittingCheckpoint(c, layer, 20);
  const float scaled = -8.0f;
  for (size_t i = 0; i < poisoned.payload().size(); i += 4) {
    std::memcpy(poisoned.mutable_payload()->data() + i, &scaled, 4);
  }
  ASSERT_TRUE(controller_->checkpoint_gate().Save(poisoned).ok());
  EXPECT_EQ(controller_->checkpoint_gate().Load(c, layer)->step(), 20);
  clock_.AdvanceMs(10);
  for (const std::string& id : {first_, last_}) Heartbeat(id, 0);
  EXPECT_TRUE(controller_->RevokeWorker(c));
  ASSERT_EQ(Plan().stages(1).worker_id(), last_);
  absl::StatusOr<v1::LayerCheckpoint> restored = controller_->checkpoint_gate().Load(last_, layer);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), 10);
  EXPECT_EQ(restored->payload(), std::string(restored->payload().size(), '\0'));
}

}  // namespace
}  // namespace geotrain

namespace geotrain {
namespace {

// Issue 32: a stalled stream froze training for good. The progress
// watchdog follows whom the workers wait on to the stalled worker.
class ProgressWatchdogTest : public ProgressClaimTest {
 protected:
  void SetUp() override {
    ProgressClaimTest::SetUp();
    standby_ = Join("c").worker_id();
  }
  // Every member heartbeats (stage 0 at `step`), `waiter` saying it has
  // waited on `on` for `waited_s`; then `ms` pass in 200 ms ticks.
  void Beat(int ms, int step, const std::string& waiter = "", const std::string& on = "",
            double waited_s = 0) {
    for (int t = 0; t < ms; t += 200) {
      clock_.AdvanceMs(200);
      for (const std::string& id : {first_, last_, standby_}) {
        v1::HeartbeatRequest beat;
        beat.set_worker_id(id);
        beat.set_epoch(Plan().epoch());
        if (id == first_) beat.set_step(step);
        if (id == waiter) {
          beat.mutable_stats()->set_waiting_on(on);
          beat.mutable_stats()->set_waiting_s(waited_s + t / 1000.0);
        }
        controller_->Heartbeat(beat);
      }
      controller_->Tick();
    }
  }
  std::string standby_;
};

TEST_F(ProgressWatchdogTest, AStalledWorkerIsFoundByWhoWaitsOnIt) {
  TrainSteps(first_, last_, 5);
  Beat(1000, 5);
  EXPECT_EQ(Plan().epoch(), 1u) << "half a limit without a step is no stall";
  // Stage 0 has waited on the last stage, which waits on nobody.
  Beat(1600, 5, first_, last_, 1.0);
  EXPECT_TRUE(HasEvent("stalled"));
  const v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  EXPECT_EQ(plan.stages(1).worker_id(), standby_) << "the stalled worker was taken out";
  EXPECT_EQ(plan.stages(0).worker_id(), first_);
}

TEST_F(ProgressWatchdogTest, WithNobodyOwedAnythingStageZeroIsTakenOut) {
  TrainSteps(first_, last_, 5);
  Beat(2600, 5);
  EXPECT_TRUE(HasEvent("stalled"));
  const v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), 2u);
  EXPECT_EQ(plan.stages(0).worker_id(), standby_);
}

TEST_F(ProgressWatchdogTest, ASlowButSteadyJobIsNoStall) {
  for (int step = 1; step <= 6; ++step) {
    v1::StepReport report;
    report.set_worker_id(last_);
    report.set_epoch(1);
    report.set_step(step);
    report.set_loss(2.0);
    report.set_samples(8);
    ASSERT_TRUE(controller_->ReportStep(report).ok());
    Beat(1800, step);  // a step every 1.8 s, nearly two leases
  }
  EXPECT_EQ(controller_->Status().step(), 6);
  EXPECT_FALSE(HasEvent("stalled"));
  EXPECT_EQ(Plan().epoch(), 1u);
}

// After the last step the workers upload final checkpoints and report
// DONE, which on a thin link takes more than the limit: nothing is owed, so
// that is no stall (the lab's 20 Mb/s runs re-planned twice at the end).
TEST_F(ProgressWatchdogTest, AfterTheLastStepNothingIsOwed) {
  for (int step = 1; step <= 3000; ++step) {
    ASSERT_TRUE(Claim(step).ok()) << step;
    FinishedOnStageZero(first_, step);
    clock_.AdvanceMs(1);
    if (step % 500 == 0) Beat(400, step);  // leases kept, under the claims' rate limit
  }
  ASSERT_EQ(controller_->Status().step(), 3000);
  Beat(10000, 3000, first_, last_, 1.0);
  EXPECT_FALSE(HasEvent("stalled"));
  EXPECT_EQ(Plan().epoch(), 1u);
}

TEST_F(ProgressWatchdogTest, ANewPlanHasTimeToStart) {
  Beat(30000, 0);
  EXPECT_FALSE(HasEvent("stalled")) << "restoring state and opening links take a while";
  Beat(31000, 0);
  EXPECT_TRUE(HasEvent("stalled"));
}

}  // namespace
}  // namespace geotrain

namespace geotrain {
namespace {

TEST_F(ReplanTest, AWorkersEventsAreRateLimited) {
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  v1::WorkerEvent event;
  event.set_worker_id(a);
  event.set_kind("restored");
  event.set_detail("again");
  int ok = 0, refused = 0;
  for (int i = 0; i < 100; ++i) {
    const absl::Status recorded = controller_->RecordWorkerEvent(event);
    (recorded.ok() ? ok : refused) += 1;
    if (!recorded.ok()) EXPECT_EQ(recorded.code(), absl::StatusCode::kResourceExhausted);
  }
  EXPECT_EQ(ok, 20) << "the burst";
  EXPECT_EQ(refused, 80);
  event.set_worker_id(b);
  EXPECT_TRUE(controller_->RecordWorkerEvent(event).ok()) << "a bucket per worker";
  event.set_worker_id(a);
  clock_.AdvanceMs(1000);
  EXPECT_TRUE(controller_->RecordWorkerEvent(event).ok()) << "refilled at 2 a second";
  EXPECT_TRUE(controller_->RecordWorkerEvent(event).ok());
  EXPECT_EQ(controller_->RecordWorkerEvent(event).code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace geotrain
