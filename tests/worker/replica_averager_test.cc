// ReplicaAverager between two instances over real gRPC on loopback: what a
// push delivers, what is refused, and that a dead peer costs only a round.
#include "worker/replica_averager.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "common/rpc_options.h"

namespace geotrain {
namespace {

v1::LayerWeights Layer(int layer, const std::string& bytes) {
  v1::LayerWeights weights;
  weights.set_layer(layer);
  v1::TensorHeader* header = weights.add_params();
  header->set_dtype(v1::DTYPE_FLOAT32);
  header->add_shape(static_cast<int64_t>(bytes.size() / 4));
  header->set_payload_bytes(bytes.size());
  weights.set_payload(bytes);
  return weights;
}

class Served {
 public:
  Served() {
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&averager);
    server_ = builder.BuildAndStart();
  }
  ~Served() { server_->Shutdown(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  ReplicaAverager averager{absl::Milliseconds(500)};

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

ReplicaAverager::Target TargetFor(const std::string& self, const std::string& peer,
                                  const std::string& peer_address) {
  ReplicaAverager::Target target;
  target.epoch = 4;
  target.stage = 1;
  target.layer_begin = 2;
  target.layer_end = 4;
  target.self_id = self;
  target.peers = {{peer, peer_address}};
  return target;
}

template <typename Fn>
bool Eventually(Fn condition) {
  for (int i = 0; i < 200 && !condition(); ++i) absl::SleepFor(absl::Milliseconds(10));
  return condition();
}

TEST(ReplicaAveragerTest, APushReachesThePeerNewestFirst) {
  Served a, b;
  a.averager.Activate(TargetFor("a", "b", b.address()));
  b.averager.Activate(TargetFor("b", "a", a.address()));
  a.averager.Push(5, {Layer(2, std::string(16, 'x')), Layer(3, std::string(8, 'y'))});
  ASSERT_TRUE(Eventually([&] { return b.averager.counters().pushes_received == 1; }));
  std::vector<v1::LayerWeights> got = b.averager.TakeReceived().layers;
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].layer(), 2);
  EXPECT_EQ(got[1].payload(), std::string(8, 'y'));
  EXPECT_TRUE(b.averager.TakeReceived().layers.empty());  // taken once
  EXPECT_EQ(a.averager.counters().pushes_sent, 1);
}

TEST(ReplicaAveragerTest, PushesForAnotherPlanStrangersAndBadLayersAreRefused) {
  Served b;
  b.averager.Activate(TargetFor("b", "a", "unused:1"));
  auto stub = v1::ReplicaSync::NewStub(MakeChannel(b.address()));
  auto push = [&](uint64_t epoch, const std::string& from, v1::LayerWeights layer) {
    v1::ReplicaWeights request;
    request.set_epoch(epoch);
    request.set_stage(1);
    request.set_from_worker(from);
    *request.add_layers() = std::move(layer);
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::milliseconds(2000)));
    v1::PushWeightsResponse response;
    return stub->PushWeights(&context, request, &response).error_code();
  };
  EXPECT_EQ(push(3, "a", Layer(2, "abcd")), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(push(4, "mallory", Layer(2, "abcd")), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(push(4, "a", Layer(7, "abcd")), grpc::StatusCode::INVALID_ARGUMENT);
  v1::LayerWeights short_payload = Layer(2, "abcdefgh");
  short_payload.set_payload("abcd");
  EXPECT_EQ(push(4, "a", short_payload), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(b.averager.TakeReceived().layers.empty());
  EXPECT_EQ(push(4, "a", Layer(2, "abcd")), grpc::StatusCode::OK);
  EXPECT_TRUE(b.averager.TakeReceived().layers.empty());  // layer 3 still missing
  EXPECT_EQ(push(4, "a", Layer(3, "efgh")), grpc::StatusCode::OK);
  EXPECT_EQ(b.averager.TakeReceived().layers.size(), 2u);
  b.averager.Deactivate();
  EXPECT_EQ(push(4, "a", Layer(2, "abcd")), grpc::StatusCode::FAILED_PRECONDITION);
}

// A newcomer (restored from a checkpoint) adopts an established sibling's
// weights; the sibling ignores the newcomer's older ones; two newcomers
// average.
TEST(ReplicaAveragerTest, ANewcomerAdoptsAndIsNotAveragedIn) {
  Served a, b;
  a.averager.Activate(TargetFor("a", "b", b.address()));
  b.averager.Activate(TargetFor("b", "a", a.address()));
  b.averager.Push(5, {Layer(2, "new!"), Layer(3, "new!")}, /*catching_up=*/true);  // newcomer
  ASSERT_TRUE(Eventually([&] { return a.averager.counters().pushes_received == 1; }));
  EXPECT_TRUE(a.averager.TakeReceived(/*catching_up=*/false).layers.empty());

  a.averager.Push(5, {Layer(2, "est."), Layer(3, "est.")});
  ASSERT_TRUE(Eventually([&] { return b.averager.counters().pushes_received == 1; }));
  ReplicaAverager::Received got = b.averager.TakeReceived(/*catching_up=*/true);
  EXPECT_TRUE(got.adopt);
  ASSERT_EQ(got.layers.size(), 2u);
  EXPECT_EQ(got.layers[0].payload(), "est.");

  a.averager.Push(6, {Layer(2, "new2"), Layer(3, "new2")}, /*catching_up=*/true);  // both new
  ASSERT_TRUE(Eventually([&] { return b.averager.counters().pushes_received == 2; }));
  got = b.averager.TakeReceived(/*catching_up=*/true);
  EXPECT_FALSE(got.adopt);
  EXPECT_EQ(got.layers.size(), 2u);
}

TEST(ReplicaAveragerTest, ADeadPeerCostsARoundNotTheCaller) {
  ReplicaAverager a(absl::Milliseconds(300));
  a.Activate(TargetFor("a", "b", "127.0.0.1:1"));  // nobody listens
  const absl::Time start = absl::Now();
  a.Push(1, {Layer(2, "abcd")});
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));  // Push never waits
  ASSERT_TRUE(Eventually([&] { return a.counters().pushes_failed == 1; }));
}

}  // namespace
}  // namespace geotrain
