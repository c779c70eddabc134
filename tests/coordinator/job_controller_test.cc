// The composition root: joins, plans, reports, the store, restarts.
#include "controller_fixtures.h"

#include <gtest/gtest.h>

#include <sys/stat.h>

namespace geotrain {
namespace {

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
  EXPECT_NE(ReadFile(dir_ + "/progress.textproto").find("step: 3"), std::string::npos);
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
  EXPECT_EQ(ReadFile(dir_ + "/progress.textproto").find("step: 1"), std::string::npos);
  fail = false;
  report.set_step(2);
  ASSERT_TRUE(controller_->ReportStep(report).ok());
  FinishedOnStageZero(a, 2);
  controller_->FlushState();
  EXPECT_NE(ReadFile(dir_ + "/progress.textproto").find("step: 2"), std::string::npos);
}

TEST_F(JobControllerTest, ACommittedStepWritesTheProgressAloneNotTheMembers) {
  Start("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} steps: 10 "
        "min_workers: 2 lease_ms: 1000");
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  controller_->FlushState();
  // Each write replaces the file by a rename: a new inode.
  const auto inode = [](const std::string& path) {
    struct stat st{};
    return stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_ino) : -1;
  };
  const int64_t members = inode(dir_ + "/members.textproto");
  ASSERT_GE(members, 0);
  EXPECT_NE(ReadFile(dir_ + "/members.textproto").find("name: \"b\""), std::string::npos);
  v1::StepReport report;
  report.set_worker_id(b);
  report.set_epoch(1);
  report.set_samples(8);
  for (int step = 1; step <= 3; ++step) {
    report.set_step(step);
    ASSERT_TRUE(controller_->ReportStep(report).ok());
    FinishedOnStageZero(a, step);
    controller_->FlushState();
  }
  EXPECT_EQ(inode(dir_ + "/members.textproto"), members);
  const std::string progress = ReadFile(dir_ + "/progress.textproto");
  EXPECT_NE(progress.find("step: 3"), std::string::npos);
  EXPECT_EQ(progress.find("members"), std::string::npos) << progress;
  // A join changes the members, and they are written again.
  Join("c");
  controller_->FlushState();
  EXPECT_NE(inode(dir_ + "/members.textproto"), members);
  EXPECT_NE(ReadFile(dir_ + "/members.textproto").find("name: \"c\""), std::string::npos);
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
