// A real coordinator and a real worker process, with TLS (the default).
// This test enrolls with a token like any worker, so it holds a valid
// worker certificate, joins first (the planner puts it on stage 0) and then
// behaves as a hostile stage 0: it sends the worker (stage 1) malformed,
// oversized, compressed-bomb and impersonating link traffic, floods it with
// streams, and stops reading. Each must be refused with a clear status while
// the worker keeps running and still trains on a correct message afterwards.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "common/commitment.h"
#include "common/layer_state.h"
#include "common/link_message.h"
#include "common/model_profile.h"
#include <zstd.h>

#include "common/rpc_options.h"
#include "common/transport_security.h"
#include "common/x509.h"
#include "geotrain/v1/coordinator.grpc.pb.h"
#include "geotrain/v1/stage.grpc.pb.h"
#include "geotrain/v1/status.grpc.pb.h"

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

// Resident memory of `pid` in bytes (VmRSS), 0 if unknown.
uint64_t ResidentBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

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
                          "--min_workers=2", "--planner=join-order",
                          "--state_dir=" + dir_ + "/state"},
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
    port_ = port;

    // A token, as the operator would make one.
    absl::StatusOr<TransportSecurity> admin =
        LoadCredentialFile(dir_ + "/state/tls/admin.credential");
    ASSERT_TRUE(admin.ok()) << admin.status();
    auto admin_stub = v1::Admin::NewStub(
        MakeSecureChannel(coordinator, *admin, kCoordinatorServerName));
    v1::CreateTokenRequest create;
    create.set_uses(2);
    v1::CreateTokenResponse token;
    {
      grpc::ClientContext context;
      context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
      ASSERT_TRUE(admin_stub->CreateToken(&context, create, &token).ok());
    }
    // Enroll like a worker: pin the CA, send a CSR, get a certificate.
    absl::StatusOr<std::string> serving_ca =
        PinCertificateAuthority(coordinator, "sha256:" + token.token().substr(token.token().rfind('.') + 1),
                                absl::Seconds(5));
    ASSERT_TRUE(serving_ca.ok()) << serving_ca.status();
    TransportSecurity anonymous;
    anonymous.insecure = false;
    anonymous.trusted_ca_pem = *serving_ca;
    const std::string key = *GeneratePrivateKeyPem();
    v1::EnrollRequest enroll;
    enroll.set_token(token.token());
    enroll.set_csr_pem(*CreateCsrPem(key, "hostile"));
    enroll.set_name("test-stage0");
    v1::EnrollResponse enrolled;
    {
      grpc::ClientContext context;
      context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
      auto stub = v1::Coordinator::NewStub(
          MakeSecureChannel(coordinator, anonymous, kCoordinatorServerName));
      const grpc::Status status = stub->Enroll(&context, enroll, &enrolled);
      ASSERT_TRUE(status.ok()) << status.error_message();
    }
    peers_.insecure = false;
    peers_.certificate_pem = enrolled.certificate_pem();
    peers_.private_key_pem = key;
    peers_.trusted_ca_pem = enrolled.ca_pem();
    TransportSecurity to_coordinator = peers_;
    to_coordinator.trusted_ca_pem = *serving_ca;
    coordinator_stub_ = v1::Coordinator::NewStub(
        MakeSecureChannel(coordinator, to_coordinator, kCoordinatorServerName));

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
    stage0_id_ = joined.worker_id();
    // Keep this test's lease from its join on (the job's lease is 5 s): the
    // worker it waits for may take longer than that to start on a loaded
    // machine, and a lapsed lease would leave the coordinator one worker
    // short of a plan.
    heartbeats_ = std::thread([this] {
      while (!stop_heartbeats_) {
        v1::HeartbeatRequest beat;
        beat.set_worker_id(stage0_id_);
        v1::HeartbeatResponse known;
        grpc::ClientContext context;
        context.set_deadline(DeadlineFromNow(std::chrono::seconds(2)));
        coordinator_stub_->Heartbeat(&context, beat, &known);
        for (int i = 0; i < 10 && !stop_heartbeats_; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      }
    });

    worker_ = Spawn({bin + "/geotrain-worker", "--coordinator=" + coordinator,
                     "--listen=127.0.0.1:0", "--device=cpu", "--threads=1", "--name=target",
                     "--token=" + token.token()},
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
    stage1_id_ = plan_.stages(1).worker_id();
    stage_stub_ = v1::Stage::NewStub(
        MakeSecureChannel(plan_.stages(1).address(), peers_, stage1_id_));
    boundary_ = plan_.stages(1).layer_begin();
    // The worker activates its stage a moment after the plan arrives.
    grpc::Status ready;
    for (auto start = Clock::now(); Clock::now() - start < std::chrono::seconds(30);) {
      ready = Exchange({});
      if (ready.error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_TRUE(ready.ok()) << "the worker never accepted a link: " << ready.error_message();
  }

  void TearDown() override {
    // A set-up that failed says why from the daemons' side too.
    if (HasFailure()) {
      for (const char* log : {"/coordinator.log", "/worker.log"}) {
        const std::string text = ReadAll(dir_ + log);
        std::cerr << "---- last of " << log << ":\n"
                  << text.substr(text.size() > 4000 ? text.size() - 4000 : 0) << "\n";
      }
    }
    stop_heartbeats_ = true;
    if (heartbeats_.joinable()) heartbeats_.join();
    for (pid_t pid : {worker_, coordinator_}) {
      if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  }

  // `m` committed to (as a sender does last) and split into frames.
  static std::vector<v1::LinkFrame> FramesOf(LinkMessage m) {
    if (IsCommittedKind(m.header.kind())) {
      m.header.set_commitment(CommitmentOf(m.header, m.payload));
    }
    return SplitIntoFrames(m);
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
                        uint64_t hello_epoch = 0, const std::string& from_worker = "",
                        bool anonymous = false) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(20)));
    auto stream = stage_stub_->Link(&context);
    v1::LinkFrame hello;
    hello.mutable_header()->set_kind(v1::MESSAGE_KIND_HELLO);
    hello.mutable_header()->set_epoch(hello_epoch ? hello_epoch : plan_.epoch());
    hello.mutable_header()->set_from_stage(0);
    // The plan names the worker that may dial: this test, as stage 0.
    hello.mutable_header()->set_from_worker(anonymous ? ""
                                            : from_worker.empty() ? stage0_id_
                                                                  : from_worker);
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

  // The same activation with its targets zstd'd (as a job with zstd sends
  // them), labels set to `label`.
  LinkMessage ZstdTargetsActivation(int64_t label) {
    LinkMessage m = GoodActivation();
    const int64_t batch = job_.microbatch_size();
    const size_t activation_bytes = m.header.tensors(0).payload_bytes();
    std::vector<int64_t> labels(batch, label);
    std::string packed(ZSTD_compressBound(batch * 8), '\0');
    packed.resize(ZSTD_compress(packed.data(), packed.size(), labels.data(), batch * 8, 1));
    m.payload.resize(activation_bytes);
    m.payload += packed;
    v1::TensorHeader* t = m.header.mutable_tensors(1);
    t->set_zstd(true);
    t->set_encoded_bytes(batch * 8);
    t->set_payload_bytes(packed.size());
    return m;
  }

  std::string dir_;
  TransportSecurity peers_;  // this test's worker certificate
  std::string stage1_id_;
  int port_ = 0;
  std::thread heartbeats_;
  std::atomic<bool> stop_heartbeats_{false};
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
  // With TLS a HELLO must name the worker of its certificate: as another
  // worker (the real stage 1, or nobody) it is refused before the plan is
  // consulted.
  cases.push_back({"hello as another worker", {}, grpc::StatusCode::PERMISSION_DENIED, 0,
                   "w-stranger"});
  cases.push_back({"hello as the worker it is sent to", {}, grpc::StatusCode::PERMISSION_DENIED,
                   0, "self"});
  cases.push_back({"anonymous hello", {}, grpc::StatusCode::PERMISSION_DENIED, 0, "anonymous"});
  {
    LinkMessage m = ZstdTargetsActivation(3);
    const float nan = std::nanf("");
    std::memcpy(&m.payload[8], &nan, 4);
    cases.push_back({"non-finite activation with zstd'd targets", FramesOf(m),
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  cases.push_back({"zstd'd targets out of range", FramesOf(ZstdTargetsActivation(1000)),
                   grpc::StatusCode::INVALID_ARGUMENT});
  {
    // A zstd bomb: a small frame that unpacks to 256 MiB, announced as the
    // targets' few bytes.
    LinkMessage m = ZstdTargetsActivation(3);
    const std::string zeros(256 << 20, '\0');
    std::string bomb(ZSTD_compressBound(zeros.size()), '\0');
    bomb.resize(ZSTD_compress(bomb.data(), bomb.size(), zeros.data(), zeros.size(), 1));
    const size_t activation_bytes = m.header.tensors(0).payload_bytes();
    m.payload.resize(activation_bytes);
    m.payload += bomb;
    m.header.mutable_tensors(1)->set_payload_bytes(bomb.size());
    cases.push_back({"zstd bomb", FramesOf(m), grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    m.header.mutable_tensors(0)->set_shape(1, m.header.tensors(0).shape(1) + 1);
    m.header.mutable_tensors(0)->set_payload_bytes(m.header.tensors(0).payload_bytes() +
                                                   4 * job_.microbatch_size());
    m.payload.append(4 * job_.microbatch_size(), '\0');
    cases.push_back({"wrong shape", FramesOf(m), grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    m.header.mutable_tensors(1)->set_dtype(v1::DTYPE_FLOAT32);
    m.header.mutable_tensors(1)->set_payload_bytes(job_.microbatch_size() * 4);
    m.payload.resize(m.payload.size() - job_.microbatch_size() * 4);
    cases.push_back({"wrong dtype", FramesOf(m), grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    m.header.set_epoch(plan_.epoch() + 1);
    cases.push_back({"wrong epoch", FramesOf(m), grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    std::vector<v1::LinkFrame> frames = FramesOf(m);
    frames[0].mutable_data()->resize(frames[0].data().size() / 2);
    cases.push_back({"payload shorter than its header", frames,
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    m.header.mutable_tensors(0)->set_payload_bytes(uint64_t{3} << 30);
    std::vector<v1::LinkFrame> frames = FramesOf(m);
    frames[0].set_last(false);
    cases.push_back({"announced size over the limit", {frames[0]},
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    const float nan = std::nanf("");
    std::memcpy(&m.payload[8], &nan, 4);
    cases.push_back({"non-finite activation", FramesOf(m),
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    LinkMessage m = GoodActivation();
    m.header.set_kind(v1::MESSAGE_KIND_GRADIENT);
    cases.push_back({"gradient sent downstream", FramesOf(m),
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  cases.push_back({"activation without a commitment", SplitIntoFrames(GoodActivation()),
                   grpc::StatusCode::INVALID_ARGUMENT});
  {
    // Committed, then changed: one finite value, or the microbatch it
    // claims to be.
    LinkMessage m = GoodActivation();
    m.header.set_commitment(CommitmentOf(m.header, m.payload));
    LinkMessage changed_value = m;
    const float value = 0.5f;
    std::memcpy(&changed_value.payload[8], &value, 4);
    cases.push_back({"payload changed after its commitment", SplitIntoFrames(changed_value),
                     grpc::StatusCode::INVALID_ARGUMENT});
    LinkMessage renamed = m;
    renamed.header.set_microbatch(1);
    cases.push_back({"commitment to another microbatch", SplitIntoFrames(renamed),
                     grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    v1::LinkFrame huge;
    huge.set_data(std::string(kMaxGrpcMessageBytes + 1024, 'x'));
    cases.push_back({"gRPC message over the size limit", {huge},
                     grpc::StatusCode::RESOURCE_EXHAUSTED});
  }

  for (const Case& c : cases) {
    const grpc::Status status = Exchange(
        c.frames, nullptr, c.hello_epoch,
        c.from_worker == "self" ? stage1_id_ : c.from_worker, c.from_worker == "anonymous");
    EXPECT_EQ(status.error_code(), c.expected)
        << c.name << ": " << status.error_code() << " " << status.error_message();
    EXPECT_FALSE(status.error_message().empty()) << c.name << " gave no reason";
    ASSERT_TRUE(Alive(worker_)) << "worker died after: " << c.name;
  }

  // The worker still serves a correct message: it returns the gradient.
  std::vector<v1::LinkFrame> received;
  const grpc::Status status = Exchange(FramesOf(GoodActivation()), &received);
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
  // The worker commits to what it sends back.
  EXPECT_TRUE(CheckCommitment(gradient->header, gradient->payload).ok());
  EXPECT_EQ(gradient->header.tensors(0).shape(0), job_.microbatch_size());
  EXPECT_TRUE(Alive(worker_));
}

// The control plane with this test's (valid) worker certificate: it may
// speak only for itself.
TEST_F(LinkRefusalTest, ControlCallsForAnotherWorkerAreRefused) {
  auto context = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
    return c;
  };
  const std::string victim = stage1_id_;
  v1::HeartbeatRequest beat;
  beat.set_worker_id(victim);
  v1::HeartbeatResponse known;
  EXPECT_EQ(coordinator_stub_->Heartbeat(context().get(), beat, &known).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::LeaveRequest leave;
  leave.set_worker_id(victim);
  v1::LeaveResponse left;
  EXPECT_EQ(coordinator_stub_->Leave(context().get(), leave, &left).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::ReportAck ack;
  v1::StepReport step;
  step.set_worker_id(victim);
  step.set_epoch(plan_.epoch());
  step.set_step(1);
  EXPECT_EQ(coordinator_stub_->ReportStep(context().get(), step, &ack).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // As itself, stage 0 vouches that it finished the step (it does not own
  // the loss): taken, and it alone moves no progress (ProgressGate).
  step.set_worker_id("");
  EXPECT_EQ(coordinator_stub_->ReportStep(context().get(), step, &ack).error_code(),
            grpc::StatusCode::OK);
  v1::DoneReport done;
  done.set_worker_id(victim);
  EXPECT_EQ(coordinator_stub_->ReportDone(context().get(), done, &ack).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // Checkpoints: NaN weights of its own layer, and a layer it does not hold.
  v1::LayerCheckpoint checkpoint;
  checkpoint.set_layer(0);
  checkpoint.set_step(1);
  const int64_t n = 784 * 256 + 256;  // fmnist-mlp's first layer, flat
  v1::TensorHeader* h = checkpoint.add_params();
  h->set_dtype(v1::DTYPE_FLOAT32);
  h->set_codec(v1::CODEC_NONE);
  h->add_shape(n);
  h->set_payload_bytes(4 * n);
  h->set_encoded_bytes(4 * n);
  std::vector<float> weights(n, std::nanf(""));
  checkpoint.set_payload(std::string(reinterpret_cast<const char*>(weights.data()), 4 * n));
  for (auto [layer, expected] : {std::pair{0, grpc::StatusCode::INVALID_ARGUMENT},
                                 std::pair{boundary_, grpc::StatusCode::PERMISSION_DENIED}}) {
    checkpoint.set_layer(layer);
    auto ctx = context();
    v1::SaveCheckpointResponse saved;
    auto writer = coordinator_stub_->SaveCheckpoint(ctx.get(), &saved);
    ForEachLayerStateChunk(checkpoint, kLayerStateChunkBytes,
                           [&](const v1::LayerStateChunk& chunk) { return writer->Write(chunk); });
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), expected) << "layer " << layer;
  }
  // The victim is still training: its heartbeats were never replaced.
  grpc::ClientContext status_context;
  status_context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
  auto admin = LoadCredentialFile(dir_ + "/state/tls/admin.credential");
  ASSERT_TRUE(admin.ok());
  auto status_stub = v1::Status::NewStub(MakeSecureChannel(
      "127.0.0.1:" + std::to_string(port_), *admin, kCoordinatorServerName));
  v1::ClusterStatus status;
  ASSERT_TRUE(status_stub->GetClusterStatus(&status_context, {}, &status).ok());
  for (const v1::WorkerStatus& w : status.workers()) {
    if (w.id() == victim) EXPECT_EQ(w.state(), v1::WORKER_STATE_TRAINING);
  }
  ASSERT_TRUE(Alive(worker_));
}

// Issue 32: 64 calls of 15 MiB without a certificate took the coordinator
// from 58 to 798 MiB, and 300 unread plan streams held 300 of its threads.
TEST_F(LinkRefusalTest, TheCoordinatorBoundsBigCallsAndPlanStreams) {
  {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(10)));
    v1::EnrollRequest big;
    big.set_csr_pem(std::string(15 << 20, 'x'));
    v1::EnrollResponse response;
    const grpc::Status status = coordinator_stub_->Enroll(&context, big, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  }
  // Two plan streams per identity; the third is refused at once.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::Plan>>> readers;
  // (The set-up's stream, cancelled, holds its place until the coordinator
  // hears of the cancellation: a stream refused meanwhile is retried.)
  for (auto start = Clock::now(); readers.size() < 2;) {
    ASSERT_LT(Clock::now() - start, std::chrono::seconds(5)) << "no two plan streams";
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(DeadlineFromNow(std::chrono::seconds(20)));
    auto reader = coordinator_stub_->WatchPlan(context.get(), v1::WatchPlanRequest());
    v1::Plan plan;
    if (!reader->Read(&plan)) {
      reader->Finish();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    contexts.push_back(std::move(context));
    readers.push_back(std::move(reader));
  }
  grpc::ClientContext third_context;
  third_context.set_deadline(DeadlineFromNow(std::chrono::seconds(10)));
  auto third = coordinator_stub_->WatchPlan(&third_context, v1::WatchPlanRequest());
  v1::Plan plan;
  EXPECT_FALSE(third->Read(&plan));
  const grpc::Status refused = third->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  for (auto& context : contexts) context->TryCancel();
  for (auto& reader : readers) reader->Finish();
}

// Issue 32: the join limit was per source address, so one stranger behind
// a NAT locked out every volunteer behind the same address. Only refused
// enrollments count against a source now.
TEST_F(LinkRefusalTest, AStrangersRefusedEnrollmentsDoNotLockOutItsNeighbours) {
  auto enroll = [this](const std::string& token) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
    v1::EnrollRequest request;
    request.set_token(token);
    request.set_csr_pem(*CreateCsrPem(*GeneratePrivateKeyPem(), "neighbour"));
    request.set_name("neighbour");
    v1::EnrollResponse response;
    return coordinator_stub_->Enroll(&context, request, &response);
  };
  grpc::StatusCode last = grpc::StatusCode::OK;
  for (int i = 0; i < 70; ++i) last = enroll("gt1.zzzzzz.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa.0").error_code();
  EXPECT_EQ(last, grpc::StatusCode::RESOURCE_EXHAUSTED) << "the stranger's own budget is spent";
  auto admin = LoadCredentialFile(dir_ + "/state/tls/admin.credential");
  ASSERT_TRUE(admin.ok());
  auto admin_stub = v1::Admin::NewStub(
      MakeSecureChannel("127.0.0.1:" + std::to_string(port_), *admin, kCoordinatorServerName));
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(std::chrono::seconds(15)));
  v1::CreateTokenRequest create;
  create.set_uses(1);
  v1::CreateTokenResponse token;
  const grpc::Status created = admin_stub->CreateToken(&context, create, &token);
  ASSERT_TRUE(created.ok()) << created.error_message();
  const grpc::Status neighbour = enroll(token.token());
  EXPECT_TRUE(neighbour.ok()) << "a volunteer behind the same address: "
                              << neighbour.error_message();
}

// Issue 32: peers accepted a revoked certificate. The plan carries the
// revoked identities, and the worker refuses them on every call.
TEST_F(LinkRefusalTest, PeersRefuseARevokedCertificate) {
  ASSERT_TRUE(Exchange({}).ok()) << "a HELLO of this test's identity is answered first";
  auto admin = LoadCredentialFile(dir_ + "/state/tls/admin.credential");
  ASSERT_TRUE(admin.ok());
  auto admin_stub = v1::Admin::NewStub(
      MakeSecureChannel("127.0.0.1:" + std::to_string(port_), *admin, kCoordinatorServerName));
  {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
    v1::RevokeWorkerRequest revoke;
    revoke.set_worker_id(stage0_id_);
    v1::RevokeWorkerResponse revoked;
    ASSERT_TRUE(admin_stub->RevokeWorker(&context, revoke, &revoked).ok());
  }
  // The worker learns it from its next plan (the revocation re-plans: this
  // identity held stage 0).
  grpc::Status probed;
  for (auto start = Clock::now(); Clock::now() - start < std::chrono::seconds(30);) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
    v1::ProbeResponse response;
    probed = stage_stub_->Probe(&context, v1::ProbeRequest(), &response);
    if (probed.error_code() == grpc::StatusCode::UNAUTHENTICATED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(probed.error_code(), grpc::StatusCode::UNAUTHENTICATED) << probed.error_message();
  EXPECT_NE(probed.error_message().find("was revoked"), std::string::npos)
      << probed.error_message();
  const grpc::Status link = Exchange({});
  EXPECT_EQ(link.error_code(), grpc::StatusCode::UNAUTHENTICATED) << link.error_message();
  ASSERT_TRUE(Alive(worker_));
}

// Issue 32: a flood of one worker's accusations costs at most two re-plans
// (the accused, then the accuser, who is excluded), never one per report.
TEST_F(LinkRefusalTest, AnAccusationFloodCostsAtMostTwoReplansAndExcludesTheAccuser) {
  const uint64_t epoch = plan_.epoch();
  std::map<grpc::StatusCode, int> codes;
  for (int i = 0; i < 50; ++i) {
    v1::WorkerEvent lost;
    lost.set_kind("link_lost");
    lost.set_peer(stage1_id_);
    lost.set_epoch(epoch + (i == 0 ? 0 : 1));  // then the epoch its first accusation caused
    v1::ReportAck ack;
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
    ++codes[coordinator_stub_->ReportEvent(&context, lost, &ack).error_code()];
  }
  // Reports of a stale epoch, or of a break counted already, change nothing;
  // past its bucket of 20, a worker's events are refused.
  EXPECT_EQ(codes[grpc::StatusCode::OK] + codes[grpc::StatusCode::RESOURCE_EXHAUSTED], 50);
  EXPECT_GE(codes[grpc::StatusCode::RESOURCE_EXHAUSTED], 25);
  grpc::ClientContext watch_context;
  watch_context.set_deadline(DeadlineFromNow(std::chrono::seconds(5)));
  v1::WatchPlanRequest watch;
  auto reader = coordinator_stub_->WatchPlan(&watch_context, watch);
  // A plan is visible once it is durable (PlanPublisher): the stream may
  // start with an older one. The newest comes within the deadline.
  v1::Plan plan;
  while (reader->Read(&plan) && plan.epoch() < epoch + 2) {
  }
  EXPECT_EQ(plan.epoch(), epoch + 2) << "two re-plans, not fifty";
  for (const v1::StageAssignment& stage : plan.stages()) {
    EXPECT_NE(stage.worker_id(), stage0_id_) << "the accuser is excluded";
  }
  watch_context.TryCancel();
  reader->Finish();
}

TEST_F(LinkRefusalTest, ADeclaredGigabyteTensorReservesNothing) {
  const uint64_t before = ResidentBytes(worker_);
  ASSERT_GT(before, 0u);
  // A header announcing 1 GiB of activation, then frames of it: refused at
  // the first frame, before anything is buffered.
  LinkMessage m = GoodActivation();
  v1::TensorHeader* a = m.header.mutable_tensors(0);
  a->set_shape(0, 1 << 18);
  a->set_payload_bytes(uint64_t{1} << 30);
  std::vector<v1::LinkFrame> frames;
  v1::LinkFrame first;
  *first.mutable_header() = m.header;
  first.set_data(std::string(1 << 20, 'x'));
  frames.push_back(first);
  for (int i = 0; i < 100; ++i) {
    v1::LinkFrame more;
    more.set_data(std::string(1 << 20, 'y'));
    frames.push_back(more);
  }
  const grpc::Status status = Exchange(frames);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  const uint64_t after = ResidentBytes(worker_);
  EXPECT_LT(after, before + (64u << 20)) << "resident memory grew from " << before << " to "
                                          << after;
  ASSERT_TRUE(Alive(worker_));
}

TEST_F(LinkRefusalTest, AThousandStreamsWithoutHelloAreBounded) {
  // Each stream is opened and left silent: the worker refuses those beyond
  // its per-peer limit at once and ends the rest when their HELLO is late.
  constexpr int kStreams = 1000;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>>> streams;
  const auto start = Clock::now();
  for (int i = 0; i < kStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(DeadlineFromNow(std::chrono::seconds(30)));
    streams.push_back(stage_stub_->Link(contexts.back().get()));
  }
  std::map<grpc::StatusCode, int> codes;
  for (auto& stream : streams) {
    v1::LinkFrame in;
    while (stream->Read(&in)) {
    }
    ++codes[stream->Finish().error_code()];
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_GE(codes[grpc::StatusCode::RESOURCE_EXHAUSTED], kStreams - 8);
  EXPECT_EQ(codes[grpc::StatusCode::OK], 0);
  EXPECT_LT(seconds, 25) << "silent streams were held";
  ASSERT_TRUE(Alive(worker_));
  // The real link still works.
  std::vector<v1::LinkFrame> received;
  const grpc::Status status = Exchange(FramesOf(GoodActivation()), &received);
  EXPECT_GE(received.size(), 2u) << status.error_message();
}

TEST_F(LinkRefusalTest, AnUpstreamThatStopsReadingIsCut) {
  // Activations keep coming, gradients are never read: once the flow-control
  // windows are full the worker's gradient writes stall, and it cuts the
  // link instead of holding it (and its buffers) for good.
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(std::chrono::seconds(90)));
  auto stream = stage_stub_->Link(&context);
  v1::LinkFrame hello;
  hello.mutable_header()->set_kind(v1::MESSAGE_KIND_HELLO);
  hello.mutable_header()->set_epoch(plan_.epoch());
  hello.mutable_header()->set_from_stage(0);
  hello.mutable_header()->set_from_worker(stage0_id_);
  hello.set_last(true);
  ASSERT_TRUE(stream->Write(hello));
  const auto start = Clock::now();
  int sent = 0;
  for (uint64_t microbatch = 0; microbatch < 100000; ++microbatch) {
    LinkMessage m = GoodActivation();
    m.header.set_microbatch(microbatch);
    bool ok = true;
    for (const v1::LinkFrame& f : FramesOf(m)) ok = ok && stream->Write(f);
    if (!ok) break;
    ++sent;
    if (Clock::now() - start > std::chrono::seconds(60)) break;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  v1::LinkFrame in;
  while (stream->Read(&in)) {
  }
  const grpc::Status status = stream->Finish();
  EXPECT_NE(status.error_code(), grpc::StatusCode::OK);
  EXPECT_LT(seconds, 45) << "the stalled link was held (" << sent << " activations sent)";
  // The worker logs the cut once its blocked write has returned, which may be
  // a moment after this end saw the stream end.
  bool logged = false;
  for (auto wait = Clock::now(); !logged && Clock::now() - wait < std::chrono::seconds(10);) {
    logged = ReadAll(dir_ + "/worker.log").find("read nothing") != std::string::npos;
    if (!logged) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(logged) << "the worker did not say why it cut the link";
  ASSERT_TRUE(Alive(worker_));
}

}  // namespace
}  // namespace geotrain
