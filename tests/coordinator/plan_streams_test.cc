// WatchPlan over real gRPC, in one process: a CoordinatorService on
// loopback and hundreds of plan streams opened with gRPC's callback client.
// Each stream gets every plan pushed from the publisher, and open streams
// hold no server thread (one thread drives them all).
#include "coordinator/plan_streams.h"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/job_controller.h"
#include "geotrain/v1/coordinator.grpc.pb.h"

namespace geotrain {
namespace {

int ProcessThreads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// One client stream: the epochs it was sent, and how it ended.
class Watcher : public grpc::ClientReadReactor<v1::Plan> {
 public:
  Watcher(v1::Coordinator::Stub* stub, const std::string& worker) {
    request_.set_worker_id(worker);
    stub->async()->WatchPlan(&context_, &request_, this);
    StartRead(&plan_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    {
      absl::MutexLock lock(&mu_);
      epochs_.push_back(plan_.epoch());
    }
    StartRead(&plan_);
  }
  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;
  }
  std::vector<uint64_t> epochs() {
    absl::MutexLock lock(&mu_);
    return epochs_;
  }
  bool WaitDone(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&done_), timeout);
  }
  grpc::Status status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  void Cancel() { context_.TryCancel(); }

 private:
  grpc::ClientContext context_;
  v1::WatchPlanRequest request_;
  v1::Plan plan_;
  absl::Mutex mu_;
  std::vector<uint64_t> epochs_ ABSL_GUARDED_BY(mu_);
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

class PlanStreamsTest : public testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = testing::TempDir() + "/plan_streams_" +
                            testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir);
    auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} "
                            "steps: 100 min_workers: 2 lease_ms: 60000",
                            "test");
    ASSERT_TRUE(job.ok()) << job.status();
    JobControllerOptions options;
    options.job = *job;
    options.state_dir = dir;
    options.clock = &clock_;
    options.planner = "join-order";
    auto controller = JobController::Create(options);
    ASSERT_TRUE(controller.ok()) << controller.status();
    controller_ = *std::move(controller);
    CoordinatorServiceOptions service;
    service.controller = controller_.get();
    service.clock = &clock_;
    service.max_watches = 1000;
    service_ = std::make_unique<CoordinatorService>(service);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    if (max_threads_ > 0) {
      grpc::ResourceQuota quota("plan_streams_test");
      quota.SetMaxThreads(max_threads_);
      builder.SetResourceQuota(quota);
    }
    builder.RegisterService(service_.get());
    service_->AttachAsyncMethods(&builder);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    service_->StartAsyncMethods();
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
  }
  void TearDown() override {
    controller_->Shutdown();
    service_->EndAsyncMethods();
    for (auto& w : watchers_) w->WaitDone(absl::Seconds(10));
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    service_->StopAsyncMethods();
  }

  void Join(const std::string& name) {
    v1::JoinRequest request;
    request.set_name(name);
    request.set_address(name + ":1");
    request.mutable_device()->set_matmul_gflops(10);
    ASSERT_TRUE(controller_->Join(request).ok());
  }

  // Waits until every watcher has been sent `epoch`.
  bool AllSent(uint64_t epoch, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      bool all = true;
      for (auto& w : watchers_) {
        std::vector<uint64_t> epochs = w->epochs();
        all = all && !epochs.empty() && epochs.back() == epoch;
      }
      if (all) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  int max_threads_ = 0;  // the synchronous handlers' cap; 0: gRPC's default
  FakeClock clock_{1000};
  std::unique_ptr<JobController> controller_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::vector<std::unique_ptr<Watcher>> watchers_;
};

TEST_F(PlanStreamsTest, EveryStreamIsPushedEveryPlanWithoutAThreadEach) {
  constexpr int kStreams = 300;
  const int threads_before = ProcessThreads();
  for (int i = 0; i < kStreams; ++i) {
    watchers_.push_back(std::make_unique<Watcher>(stub_.get(), absl::StrCat("w", 1000 + i)));
  }
  for (int i = 0; i < 200 && service_->open_plan_streams() < kStreams; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(service_->open_plan_streams(), kStreams);
  // Nothing is sent before there is a plan.
  for (auto& w : watchers_) EXPECT_TRUE(w->epochs().empty());
  // Server and client together: nowhere near a thread per stream (the
  // synchronous handler held one each, 300 here).
  const int threads_open = ProcessThreads();
  std::cout << "threads: " << threads_before << " before, " << threads_open << " with "
            << kStreams << " open plan streams" << std::endl;
  EXPECT_LT(threads_open - threads_before, 60);
  // The first plan, then a re-plan: each reaches every stream.
  Join("a");
  Join("b");
  ASSERT_TRUE(AllSent(1, absl::Seconds(20)));
  Join("c");
  controller_->Leave(controller_->Status().workers(1).id());
  ASSERT_TRUE(AllSent(2, absl::Seconds(20)));
  for (auto& w : watchers_) EXPECT_EQ(w->epochs(), (std::vector<uint64_t>{1, 2}));
  // A stream opened now starts with the plan visible.
  watchers_.push_back(std::make_unique<Watcher>(stub_.get(), "late"));
  ASSERT_TRUE(AllSent(2, absl::Seconds(20)));
  // A caller that goes away frees its place.
  watchers_.back()->Cancel();
  ASSERT_TRUE(watchers_.back()->WaitDone(absl::Seconds(10)));
  for (int i = 0; i < 200 && service_->open_plan_streams() > kStreams; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(service_->open_plan_streams(), kStreams);
  // Shutdown ends every stream, saying why.
  service_->EndAsyncMethods();
  for (auto& w : watchers_) ASSERT_TRUE(w->WaitDone(absl::Seconds(20)));
  EXPECT_EQ(watchers_.front()->status().error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(PlanStreamsTest, AStreamEndsWithTheJobDonePlan) {
  watchers_.push_back(std::make_unique<Watcher>(stub_.get(), "w100"));
  Join("a");
  Join("b");
  ASSERT_TRUE(AllSent(1, absl::Seconds(20)));
  const v1::ClusterStatus status = controller_->Status();
  const std::string first = status.workers(0).id(), last = status.workers(1).id();
  for (int step = 1; step <= 100; ++step) {
    v1::StepReport report;
    report.set_worker_id(last);
    report.set_epoch(1);
    report.set_step(step);
    report.set_samples(8);
    ASSERT_TRUE(controller_->ReportStep(report).ok());
    v1::HeartbeatRequest heartbeat;
    heartbeat.set_worker_id(first);
    heartbeat.set_epoch(1);
    heartbeat.set_step(step);
    ASSERT_TRUE(controller_->Heartbeat(heartbeat));
  }
  v1::DoneReport done;
  done.set_step(100);
  for (const std::string& id : {first, last}) {
    done.set_worker_id(id);
    ASSERT_TRUE(controller_->ReportDone(done).ok());
  }
  ASSERT_TRUE(watchers_[0]->WaitDone(absl::Seconds(20)));
  EXPECT_TRUE(watchers_[0]->status().ok()) << watchers_[0]->status().error_message();
  EXPECT_EQ(watchers_[0]->epochs(), (std::vector<uint64_t>{1, 2}));
}

}  // namespace
}  // namespace geotrain

namespace geotrain {
namespace {

// The coordinator caps its synchronous handler threads; a storm of joins,
// enrollments or uploads can hold all of them. Heartbeats are served on
// threads of their own and still return.
class BusyHandlersTest : public PlanStreamsTest {
 protected:
  BusyHandlersTest() { max_threads_ = 6; }
};

TEST_F(BusyHandlersTest, HeartbeatsNeverWaitForAHandlerThread) {
  Join("a");
  const std::string a = controller_->Status().workers(0).id();
  // Checkpoint uploads that send nothing: each holds a handler thread.
  struct Upload {
    grpc::ClientContext context;
    v1::SaveCheckpointResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::LayerStateChunk>> writer;
  };
  std::vector<std::unique_ptr<Upload>> uploads;
  for (int i = 0; i < 12; ++i) {
    auto upload = std::make_unique<Upload>();
    upload->writer = stub_->SaveCheckpoint(&upload->context, &upload->response);
    uploads.push_back(std::move(upload));
  }
  // Until a synchronous call is refused for want of a thread.
  grpc::Status refused;
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::LeaveRequest request;
    request.set_worker_id("nobody");
    v1::LeaveResponse response;
    refused = stub_->Leave(&context, request, &response);
    if (refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "the handlers were never all busy: " << refused.error_message();
  for (int i = 0; i < 50; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::HeartbeatRequest request;
    request.set_worker_id(a);
    v1::HeartbeatResponse response;
    const grpc::Status status = stub_->Heartbeat(&context, request, &response);
    ASSERT_TRUE(status.ok()) << i << ": " << status.error_message();
    EXPECT_TRUE(response.known());
  }
  for (auto& upload : uploads) upload->context.TryCancel();
}

}  // namespace
}  // namespace geotrain
