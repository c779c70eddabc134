// The JobController fixtures the controller's tests share: a controller on a
// FakeClock over a state dir (JobControllerTest), with hand-driven
// heartbeats and fault reports (ReplanTest), checkpoints that fit the model
// (HostileInputTest), and a trained two-stage job (ProgressClaimTest).
#ifndef GEOTRAIN_TESTS_COORDINATOR_CONTROLLER_FIXTURES_H_
#define GEOTRAIN_TESTS_COORDINATOR_CONTROLLER_FIXTURES_H_

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
#include "common/layer_state.h"


namespace geotrain {

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
  absl::Status WriteMembers(const v1::CoordinatorState& members) override {
    if (before_state_write_) {
      if (absl::Status injected = before_state_write_(); !injected.ok()) return injected;
    }
    return files_.WriteMembers(members);
  }
  absl::Status WriteProgress(const v1::CoordinatorState& progress) override {
    if (before_state_write_) {
      if (absl::Status injected = before_state_write_(); !injected.ok()) return injected;
    }
    return files_.WriteProgress(progress);
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
    options.heartbeat_ms = std::max(100, job->lease_ms() / 5);  // as main.cc
    options.authenticated_callers = authenticated_callers_;
    if (before_state_write_ || before_plan_write_) {
      absl::StatusOr<StateStore> files = StateStore::Open(dir_);
      ASSERT_TRUE(files.ok()) << files.status();
      options.store = std::make_shared<HookedStore>(*std::move(files), before_state_write_,
                                                    before_plan_write_);
    }
    options.before_log_write = before_log_write_;
    options.planner = planner_;
    options.custom_planner = custom_planner_;
    options.max_planner_candidates = max_planner_candidates_;
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
    options.heartbeat_ms = std::max(100, job_.lease_ms() / 5);
    options.authenticated_callers = authenticated_callers_;
    options.planner = planner_;
    options.custom_planner = custom_planner_;
    options.max_planner_candidates = max_planner_candidates_;
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
  std::shared_ptr<const Planner> custom_planner_;  // instead of planner_
  size_t max_planner_candidates_ = 1000;
  v1::JobSpec job_;
  std::string dir_;
  std::unique_ptr<JobController> controller_;
};

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

// What a hostile (or broken) worker may say, each refused with the
// controller still working; regressions of the attacks in issue 11.
class HostileInputTest : public ReplanTest {
 protected:
  // A checkpoint of `layer` that fits the model (ZeroLayerCheckpoint).
  v1::LayerCheckpoint FittingCheckpoint(const std::string& worker, int layer, int step,
                         int state_per_param = 0) {
    return geotrain::ZeroLayerCheckpoint(job_, worker, layer, step, state_per_param);
  }
};

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

}  // namespace geotrain

#endif  // GEOTRAIN_TESTS_COORDINATOR_CONTROLLER_FIXTURES_H_
