// A real coordinator and a real worker process; this test joins as the
// worker of stage 0 and sends the worker (stage 1) malformed link traffic.
// Each bad message must end its stream with INVALID_ARGUMENT (or gRPC's own
// RESOURCE_EXHAUSTED for an over-limit message) while the worker keeps
// running and still trains on a correct message afterwards.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <thread>

#include "common/link_message.h"
#include "common/model_profile.h"
#include "common/rpc_options.h"
#include "geotrain/v1/coordinator.grpc.pb.h"
#include "geotrain/v1/stage.grpc.pb.h"

namespace geotrain {
namespace {

using Clock = std::chrono::steady_clock;

pid_t Spawn(const std::vector<std::string>& args, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

bool Alive(pid_t pid) { return waitpid(pid, nullptr, WNOHANG) == 0; }

class LinkRefusalTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TempDir() + "/link_refusal";
    system(("rm -rf " + dir_ + " && mkdir -p " + dir_).c_str());
    const std::string bin = GEOTRAIN_BIN_DIR;
    coordinator_ = Spawn({bin + "/geotrain-coordinator", "--listen=127.0.0.1:0",
                          "--port_file=" + dir_ + "/port",
                          "--job=" + std::string(GEOTRAIN_SOURCE_DIR) +
                              "/deploy/jobs/fmnist-mlp.textproto",
                          "--min_workers=2", "--state_dir=" + dir_ + "/state", "--insecure"},
                         dir_ + "/coordinator.log");
    int port = 0;
    for (auto start = Clock::now(); port == 0 && Clock::now() - start < std::chrono::seconds(30);) {
      std::ifstream in(dir_ + "/port");
      if (!(in >> port)) {
        port = 0;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    ASSERT_NE(port, 0) << "coordinator did not start";
    const std::string coordinator = "127.0.0.1:" + std::to_string(port);
    coordinator_stub_ = v1::Coordinator::NewStub(MakeChannel(coordinator));

    // Join first, so that the planner puts this test on stage 0.
    v1::JoinRequest join;
    join.set_name("test-stage0");
    join.set_address("127.0.0.1:1");
    join.mutable_device()->set_matmul_gflops(1);
    grpc::ClientContext join_context;
    join_context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
    v1::JoinResponse joined;
    ASSERT_TRUE(coordinator_stub_->Join(&join_context, join, &joined).ok());
    job_ = joined.job();

    worker_ = Spawn({bin + "/geotrain-worker", "--coordinator=" + coordinator,
                     "--listen=127.0.0.1:0", "--device=cpu", "--threads=1", "--name=target",
                     "--insecure"},
                    dir_ + "/worker.log");

    grpc::ClientContext watch_context;
    watch_context.set_deadline(DeadlineFromNow(std::chrono::seconds(60)));
    v1::WatchPlanRequest watch;
    watch.set_worker_id(joined.worker_id());
    auto reader = coordinator_stub_->WatchPlan(&watch_context, watch);
    ASSERT_TRUE(reader->Read(&plan_)) << "no plan";
    watch_context.TryCancel();
    reader->Finish();
    ASSERT_EQ(plan_.stages_size(), 2);
    ASSERT_EQ(plan_.stages(0).worker_id(), joined.worker_id());
    stage0_id_ = joined.worker_id();
    stage_stub_ = v1::Stage::NewStub(MakeChannel(plan_.stages(1).address()));
    boundary_ = plan_.stages(1).layer_begin();
  }

  void TearDown() override {
    for (pid_t pid : {worker_, coordinator_}) {
      if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  }

  // A correct activation message for stage 1 of the current plan.
  LinkMessage GoodActivation() {
    LinkMessage m;
    m.header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
    m.header.set_epoch(plan_.epoch());
    m.header.set_microbatch(0);
    m.header.set_from_stage(0);
    const int64_t batch = job_.microbatch_size();
    TensorSpec act = LayerInputSpec(job_, boundary_, batch);
    v1::TensorHeader* a = m.header.add_tensors();
    int64_t n = 1;
    for (int64_t d : act.shape) {
      a->add_shape(d);
      n *= d;
    }
    a->set_dtype(v1::DTYPE_FLOAT32);
    a->set_codec(v1::CODEC_NONE);
    a->set_payload_bytes(n * 4);
    std::vector<float> values(n);
    for (int64_t i = 0; i < n; ++i) values[i] = std::sin(0.1f * i);
    m.payload.assign(reinterpret_cast<const char*>(values.data()), n * 4);
    v1::TensorHeader* t = m.header.add_tensors();
    t->add_shape(batch);
    t->set_dtype(v1::DTYPE_INT64);
    t->set_codec(v1::CODEC_NONE);
    t->set_payload_bytes(batch * 8);
    std::vector<int64_t> labels(batch, 3);
    m.payload.append(reinterpret_cast<const char*>(labels.data()), batch * 8);
    return m;
  }

  // Opens a stream, sends `frames` (a HELLO first unless `hello` is false),
  // half-closes and returns how the worker ended the stream, plus the
  // frames it sent back.
  grpc::Status Exchange(const std::vector<v1::LinkFrame>& frames,
                        std::vector<v1::LinkFrame>* received = nullptr,
                        uint64_t hello_epoch = 0, const std::string& from_worker = "") {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(20)));
    auto stream = stage_stub_->Link(&context);
    v1::LinkFrame hello;
    hello.mutable_header()->set_kind(v1::MESSAGE_KIND_HELLO);
    hello.mutable_header()->set_epoch(hello_epoch ? hello_epoch : plan_.epoch());
    hello.mutable_header()->set_from_stage(0);
    // The plan names the worker that may dial: this test, as stage 0.
    hello.mutable_header()->set_from_worker(from_worker.empty() ? stage0_id_ : from_worker);
    hello.set_last(true);
    stream->Write(hello);
    for (const v1::LinkFrame& f : frames) {
      if (!stream->Write(f)) break;
    }
    v1::LinkFrame in;
    std::vector<v1::LinkFrame> got;
    // Read until the worker answers what we sent with a whole message (the
    // last frame of one after its HELLO), or ends the stream.
    auto answered = [&] {
      return received ? got.size() >= 2 && got.back().last() : !got.empty();
    };
    while (!answered()) {
      if (!stream->Read(&in)) break;
      got.push_back(in);
    }
    stream->WritesDone();
    while (stream->Read(&in)) got.push_back(in);
    if (received) *received = got;
    return stream->Finish();
  }

  std::string dir_;
  pid_t coordinator_ = -1, worker_ = -1;
  std::unique_ptr<v1::Coordinator::Stub> coordinator_stub_;
  std::unique_ptr<v1::Stage::Stub> stage_stub_;
  v1::JobSpec job_;
  v1::Plan plan_;
  std::string stage0_id_;
  int boundary_ = 0;
};

TEST_F(LinkRefusalTest, BadMessagesAreRefusedAndTheWorkerKeepsWorking) {
  struct Case {
    const char* name;
    std::vector<v1::LinkFrame> frames;
    grpc::StatusCode expected;
    uint64_t hello_epoch = 0;
    std::string from_worker;
  };
  std::vector<Case> cases;

  // A future epoch is "not yet": the dialler saw the plan first and retries.
  cases.push_back({"hello of an epoch the worker has not started", {},
                   grpc::StatusCode::FAILED_PRECONDITION, plan_.epoch() + 7});
  cases.push_back({"hello from a worker the plan does not name", {},
                   grpc::StatusCode::INVALID_ARGUMENT, 0, "w-stranger"});
  {
    LinkMessage m = GoodActivation();
    m.header.mutable_tensors(0)->set_shape(1, m.header.tensors(0).shape(1) + 1);
    m.header.mutable_tensors(0)->set_payload_bytes(m.header.tensors(0).payload_bytes() +
                                                   4 * job_.microbatch_size());
    m.payload.append(4 * job_.microbatch_size(), '\0');
    cases.push_back({"wrong shape", SplitIntoFrames(m), grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    m.header.mutable_tensors(1)->set_dtype(v1::DTYPE_FLOAT32);
    m.header.mutable_tensors(1)->set_payload_bytes(job_.microbatch_size() * 4);
    m.payload.resize(m.payload.size() - job_.microbatch_size() * 4);
    cases.push_back({"wrong dtype", SplitIntoFrames(m), grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    m.header.set_epoch(plan_.epoch() + 1);
    cases.push_back({"wrong epoch", SplitIntoFrames(m), grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    std::vector<v1::LinkFrame> frames = SplitIntoFrames(m);
    frames[0].mutable_data()->resize(frames[0].data().size() / 2);
    cases.push_back({"payload shorter than its header", frames,
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    m.header.mutable_tensors(0)->set_payload_bytes(uint64_t{3} << 30);
    std::vector<v1::LinkFrame> frames = SplitIntoFrames(m);
    frames[0].set_last(false);
    cases.push_back({"announced size over the limit", {frames[0]},
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    const float nan = std::nanf("");
    std::memcpy(&m.payload[8], &nan, 4);
    cases.push_back({"non-finite activation", SplitIntoFrames(m),
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    m.header.set_kind(v1::MESSAGE_KIND_GRADIENT);
    cases.push_back({"gradient sent downstream", SplitIntoFrames(m),
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    v1::LinkFrame huge;
    huge.set_data(std::string(kMaxGrpcMessageBytes + 1024, 'x'));
    cases.push_back({"gRPC message over the size limit", {huge},
                     grpc::StatusCode::RESOURCE_EXHAUSTED});
  }

  for (const Case& c : cases) {
    const grpc::Status status = Exchange(c.frames, nullptr, c.hello_epoch, c.from_worker);
    EXPECT_EQ(status.error_code(), c.expected)
        << c.name << ": " << status.error_code() << " " << status.error_message();
    EXPECT_FALSE(status.error_message().empty()) << c.name << " gave no reason";
    ASSERT_TRUE(Alive(worker_)) << "worker died after: " << c.name;
  }

  // The worker still serves a correct message: it returns the gradient.
  std::vector<v1::LinkFrame> received;
  const grpc::Status status = Exchange(SplitIntoFrames(GoodActivation()), &received);
  ASSERT_GE(received.size(), 2u) << status.error_message();
  EXPECT_EQ(received[0].header().kind(), v1::MESSAGE_KIND_HELLO);
  FrameAssembler assembler;
  std::optional<LinkMessage> gradient;
  for (size_t i = 1; i < received.size() && !gradient; ++i) {
    auto added = assembler.Add(received[i]);
    ASSERT_TRUE(added.ok());
    if (added->has_value()) gradient = **added;
  }
  ASSERT_TRUE(gradient.has_value());
  EXPECT_EQ(gradient->header.kind(), v1::MESSAGE_KIND_GRADIENT);
  EXPECT_EQ(gradient->header.tensors(0).shape(0), job_.microbatch_size());
  EXPECT_TRUE(Alive(worker_));
}

}  // namespace
}  // namespace geotrain
