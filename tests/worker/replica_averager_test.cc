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
  // The sender counts the push once its call returns, which may be after
  // the receiver has it.
  EXPECT_TRUE(Eventually([&] { return a.averager.counters().pushes_sent == 1; }));
}

// A layer larger than a message (and than gRPC's 16 MiB message limit)
// arrives whole, cut into ~1 MiB parts.
TEST(ReplicaAveragerTest, ALayerOfAnySizeGoesThroughInParts) {
  Served a, b;
  a.averager.Activate(TargetFor("a", "b", b.address()));
  b.averager.Activate(TargetFor("b", "a", a.address()));
  std::string large(20 << 20, '\0');
  for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<char>(i * 7 % 251);
  a.averager.Push(9, {Layer(2, large), Layer(3, std::string(12, 'z'))});
  ASSERT_TRUE(Eventually([&] { return b.averager.counters().pushes_received == 1; }));
  std::vector<v1::LayerWeights> got = b.averager.TakeReceived().layers;
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].params_size(), 1);
  EXPECT_TRUE(got[0].payload() == large);
  EXPECT_EQ(got[1].payload(), std::string(12, 'z'));
}

class RefusalTest : public ::testing::Test {
 protected:
  RefusalTest() {
    ReplicaAverager::Target target = TargetFor("b", "a", "unused:1");
    target.max_layer_bytes = 64;
    b_.averager.Activate(target);
    stub_ = v1::ReplicaSync::NewStub(MakeChannel(b_.address()));
  }
  static v1::ReplicaWeights Message(uint64_t epoch, const std::string& from,
                                    std::vector<v1::LayerWeights> parts, int step = 1) {
    v1::ReplicaWeights message;
    message.set_epoch(epoch);
    message.set_stage(1);
    message.set_from_worker(from);
    message.set_step(step);
    for (v1::LayerWeights& part : parts) *message.add_layers() = std::move(part);
    return message;
  }
  // A part of layer `layer` at `offset` without headers.
  static v1::LayerWeights Part(int layer, uint64_t offset, const std::string& bytes) {
    v1::LayerWeights part;
    part.set_layer(layer);
    part.set_payload_offset(offset);
    part.set_payload(bytes);
    return part;
  }
  grpc::StatusCode Push(const std::vector<v1::ReplicaWeights>& messages) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::milliseconds(2000)));
    v1::PushWeightsResponse response;
    auto writer = stub_->PushWeights(&context, &response);
    for (const v1::ReplicaWeights& message : messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    return writer->Finish().error_code();
  }
  bool NothingKept() { return b_.averager.TakeReceived().layers.empty(); }

  Served b_;
  std::unique_ptr<v1::ReplicaSync::Stub> stub_;
};

TEST_F(RefusalTest, AnotherPlanAStrangerAndALayerOfAnotherStage) {
  EXPECT_EQ(Push({Message(3, "a", {Layer(2, "abcd"), Layer(3, "efgh")})}),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Push({Message(4, "mallory", {Layer(2, "abcd"), Layer(3, "efgh")})}),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Push({Message(4, "a", {Layer(7, "abcd")})}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Push({}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(NothingKept());
  EXPECT_EQ(Push({Message(4, "a", {Layer(2, "abcd"), Layer(3, "efgh")})}), grpc::StatusCode::OK);
  EXPECT_EQ(b_.averager.TakeReceived().layers.size(), 2u);
  b_.averager.Deactivate();
  EXPECT_EQ(Push({Message(4, "a", {Layer(2, "abcd"), Layer(3, "efgh")})}),
            grpc::StatusCode::FAILED_PRECONDITION);
}

// Parts out of place, too many bytes, a push cut short: refused, and
// nothing of the push is kept.
TEST_F(RefusalTest, PartsMustContinueWhereTheLastEndedAndEndComplete) {
  v1::LayerWeights head = Layer(2, "abcdefgh");
  head.set_payload("abcd");  // the first 4 of its 8 bytes
  const v1::ReplicaWeights tail3 = Message(4, "a", {Layer(3, "wxyz")});
  // Complete: the first part, then the rest in a second message.
  EXPECT_EQ(Push({Message(4, "a", {head}), Message(4, "a", {Part(2, 4, "efgh")}), tail3}),
            grpc::StatusCode::OK);
  std::vector<v1::LayerWeights> got = b_.averager.TakeReceived().layers;
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].payload(), "abcdefgh");

  // A gap, an overlap, headers again, a part before the first.
  EXPECT_EQ(Push({Message(4, "a", {head, Part(2, 5, "fgh")}), tail3}),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Push({Message(4, "a", {head, Part(2, 2, "cdefgh")}), tail3}),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::LayerWeights again = Layer(2, "efgh");
  again.set_payload_offset(4);
  EXPECT_EQ(Push({Message(4, "a", {head, again}), tail3}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Push({Message(4, "a", {Part(2, 4, "efgh")}), tail3}),
            grpc::StatusCode::INVALID_ARGUMENT);
  // More than the headers describe; a push that stops short or lacks a layer.
  EXPECT_EQ(Push({Message(4, "a", {head, Part(2, 4, "efghi")}), tail3}),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Push({Message(4, "a", {head}), tail3}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Push({Message(4, "a", {Layer(2, "abcd")})}), grpc::StatusCode::INVALID_ARGUMENT);
  // Another step in the middle of a push.
  EXPECT_EQ(Push({Message(4, "a", {head}), Message(4, "a", {Part(2, 4, "efgh")}, 2), tail3}),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Headers declaring more than the layer can hold (64 bytes here), before
  // a byte of it arrives; a forged 2^60 as well.
  EXPECT_EQ(Push({Message(4, "a", {Layer(2, std::string(68, 'q'))})}),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::LayerWeights forged = Layer(2, "");
  forged.mutable_params(0)->set_payload_bytes(uint64_t{1} << 60);
  EXPECT_EQ(Push({Message(4, "a", {forged})}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(NothingKept());
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
