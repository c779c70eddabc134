#include "worker/stage_state_server.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <thread>

#include "common/rpc_options.h"

namespace geotrain {
namespace {

v1::LayerCheckpoint Layer(int layer, size_t floats) {
  v1::LayerCheckpoint c;
  c.set_layer(layer);
  c.set_step(9);
  v1::TensorHeader* h = c.add_params();
  h->add_shape(static_cast<int64_t>(floats));
  h->set_dtype(v1::DTYPE_FLOAT32);
  h->set_codec(v1::CODEC_NONE);
  h->set_payload_bytes(4 * floats);
  for (size_t i = 0; i < 4 * floats; ++i) c.mutable_payload()->push_back(static_cast<char>(i % 7));
  return c;
}

class StageStateServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&server_);
    grpc_server_ = builder.BuildAndStart();
    ASSERT_NE(port_, 0);
  }
  void TearDown() override { grpc_server_->Shutdown(); }

  absl::StatusOr<std::vector<v1::LayerCheckpoint>> Fetch(const std::string& who, uint64_t epoch,
                                                         int begin, int end) {
    v1::FetchLayerStateRequest request;
    request.set_epoch(epoch);
    request.set_worker_id(who);
    request.set_layer_begin(begin);
    request.set_layer_end(end);
    return FetchStageState("127.0.0.1:" + std::to_string(port_), "holder",
                           TransportSecurity::Insecure(), request, 1 << 24, absl::Seconds(5));
  }

  StageStateServer server_{absl::Milliseconds(200)};
  std::unique_ptr<grpc::Server> grpc_server_;
  int port_ = 0;
};

// 3 MiB layers cross in several chunks; each newcomer gets the snapshot
// once, and it is dropped when both have it.
TEST_F(StageStateServerTest, ServesTheOfferToTheNewcomersItNames) {
  const std::vector<v1::LayerCheckpoint> layers = {Layer(2, 3 << 18), Layer(3, 10)};
  server_.Offer(4, 2, 4, {"e", "f"}, layers);
  auto got = Fetch("e", 4, 2, 4);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 2u);
  EXPECT_EQ((*got)[0].SerializeAsString(), layers[0].SerializeAsString());
  EXPECT_EQ((*got)[1].SerializeAsString(), layers[1].SerializeAsString());
  EXPECT_EQ(Fetch("e", 4, 2, 4).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Fetch("x", 4, 2, 4).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Fetch("f", 4, 2, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Fetch("f", 3, 2, 4).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Fetch("f", 4, 2, 4).ok());
  EXPECT_EQ(server_.counters().layers_served, 4);
  // Both have it: the snapshot is gone.
  EXPECT_EQ(Fetch("f", 4, 2, 4).status().code(), absl::StatusCode::kFailedPrecondition);
}

// A fetch that arrives first waits for the holder's offer; one for an epoch
// nobody offers gives up after the wait.
TEST_F(StageStateServerTest, AnEarlyFetchWaitsForTheOffer) {
  std::thread offer([this] {
    absl::SleepFor(absl::Milliseconds(50));
    server_.Offer(7, 0, 1, {"e"}, {Layer(0, 4)});
  });
  EXPECT_TRUE(Fetch("e", 7, 0, 1).ok());
  offer.join();
  EXPECT_EQ(Fetch("e", 8, 0, 1).status().code(), absl::StatusCode::kFailedPrecondition);
}

// Issue 32: 400 fetches for a future epoch held 399 of a worker's threads,
// each up to 30 s. One caller may keep two waiting.
TEST(StageStateServerLimitTest, OneCallerHoldsAtMostTwoWaitingFetches) {
  StageStateServer server(absl::Seconds(4));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&server);
  std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  auto fetch = [port](const std::string& who) {
    v1::FetchLayerStateRequest request;
    request.set_epoch(99);  // never offered
    request.set_worker_id(who);
    request.set_layer_begin(0);
    request.set_layer_end(1);
    return FetchStageState("127.0.0.1:" + std::to_string(port), "holder",
                           TransportSecurity::Insecure(), request, 1 << 20, absl::Seconds(10))
        .status();
  };
  std::vector<std::thread> waiting;
  std::vector<absl::Status> waited(2);
  for (int i = 0; i < 2; ++i) waiting.emplace_back([&, i] { waited[i] = fetch("e"); });
  absl::SleepFor(absl::Seconds(1));  // both are waiting for the offer by now
  const absl::Time start = absl::Now();
  const absl::Status third = fetch("e");
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "refused at once, not after a wait";
  for (std::thread& t : waiting) t.join();
  for (const absl::Status& s : waited) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  }
  grpc_server->Shutdown();
}

}  // namespace
}  // namespace geotrain
