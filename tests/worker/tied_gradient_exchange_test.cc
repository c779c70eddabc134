// TiedGradientExchange between two instances over real gRPC on loopback:
// both ends get the other's sum, large sums go in parts, and what is not
// the plan's other end, of the matrix's size and in order, is refused.
#include "worker/tied_gradient_exchange.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <thread>

#include "absl/time/clock.h"
#include "common/rpc_options.h"

namespace geotrain {
namespace {

class Served {
 public:
  explicit Served(absl::Duration wait_limit = absl::Seconds(10))
      : exchange(absl::Seconds(5), 1 << 20, wait_limit) {
    grpc::ServerBuilder builder;
    ConfigureServerBuilder(&builder);
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&exchange);
    server_ = builder.BuildAndStart();
  }
  ~Served() { server_->Shutdown(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  TiedGradientExchange exchange;

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

constexpr uint64_t kBytes = 3 * (1 << 20) + 12;  // more than one part

TiedGradientExchange::Target TargetFor(int stage, const std::string& self, int peer_stage,
                                       const std::string& peer, const std::string& address) {
  TiedGradientExchange::Target target;
  target.epoch = 3;
  target.stage = stage;
  target.self_id = self;
  target.peer_stage = peer_stage;
  target.peer_id = peer;
  target.peer_address = address;
  target.gradient_bytes = kBytes;
  return target;
}

TEST(TiedGradientExchangeTest, EachEndGetsTheOthersSumUpdateAfterUpdate) {
  Served first, last;
  first.exchange.Activate(TargetFor(0, "w0", 2, "w2", last.address()));
  last.exchange.Activate(TargetFor(2, "w2", 0, "w0", first.address()));
  for (int64_t update : {2, 4, 6}) {
    const std::string embedding(kBytes, static_cast<char>('a' + update));
    const std::string head(kBytes, static_cast<char>('A' + update));
    absl::StatusOr<std::string> at_first;
    std::thread other([&] { at_first = first.exchange.Exchange(update, embedding); });
    const absl::StatusOr<std::string> at_last = last.exchange.Exchange(update, head);
    other.join();
    ASSERT_TRUE(at_first.ok()) << at_first.status();
    ASSERT_TRUE(at_last.ok()) << at_last.status();
    EXPECT_EQ(*at_first, head);
    EXPECT_EQ(*at_last, embedding);
  }
}

TEST(TiedGradientExchangeTest, APeerThatSendsNothingIsNamedAndAPlanChangeEndsTheWait) {
  Served first(absl::Milliseconds(300)), last;
  first.exchange.Activate(TargetFor(0, "w0", 2, "w2", last.address()));
  last.exchange.Activate(TargetFor(2, "w2", 0, "w0", first.address()));
  const absl::StatusOr<std::string> waited = first.exchange.Exchange(1, std::string(kBytes, 'x'));
  ASSERT_EQ(waited.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(waited.status().message().find("'w2' (stage 2"), std::string::npos) << waited.status();

  // Unreachable: the push itself fails, naming the peer.
  Served lone;
  lone.exchange.Activate(TargetFor(0, "w0", 2, "w2", "127.0.0.1:1"));
  const absl::StatusOr<std::string> unreachable = lone.exchange.Exchange(1, std::string(kBytes, 'x'));
  ASSERT_EQ(unreachable.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(unreachable.status().message().find("could not be sent to 'w2'"), std::string::npos)
      << unreachable.status();

  // A re-plan (Deactivate) ends a wait at once.
  Served patient(absl::Minutes(5));
  patient.exchange.Activate(TargetFor(0, "w0", 2, "w2", last.address()));
  last.exchange.Activate(TargetFor(2, "w2", 0, "w0", patient.address()));
  std::thread replan([&] {
    absl::SleepFor(absl::Milliseconds(200));
    patient.exchange.Deactivate();
  });
  const absl::Time start = absl::Now();
  const absl::StatusOr<std::string> aborted = patient.exchange.Exchange(5, std::string(kBytes, 'x'));
  replan.join();
  EXPECT_EQ(aborted.status().code(), absl::StatusCode::kAborted) << aborted.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

// Raw pushes, as a stranger or a broken peer would send them.
class RefusalTest : public testing::Test {
 protected:
  void SetUp() override {
    served_.exchange.Activate(TargetFor(0, "w0", 2, "w2", "127.0.0.1:1"));
    stub_ = v1::TiedEmbedding::NewStub(
        grpc::CreateChannel(served_.address(), grpc::InsecureChannelCredentials()));
  }
  static v1::TiedGradientPart Part(uint64_t offset, size_t bytes, int64_t update = 1,
                                   const std::string& from = "w2", int stage = 2,
                                   uint64_t total = kBytes) {
    v1::TiedGradientPart part;
    part.set_epoch(3);
    part.set_from_stage(stage);
    part.set_from_worker(from);
    part.set_update(update);
    part.set_total_bytes(total);
    part.set_offset(offset);
    part.set_data(std::string(bytes, 'z'));
    return part;
  }
  grpc::Status Push(const std::vector<v1::TiedGradientPart>& parts) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(std::chrono::seconds(10)));
    v1::PushTiedGradientResponse response;
    auto writer = stub_->PushGradient(&context, &response);
    for (const v1::TiedGradientPart& part : parts) {
      if (!writer->Write(part)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }
  Served served_;
  std::unique_ptr<v1::TiedEmbedding::Stub> stub_;
};

TEST_F(RefusalTest, OnlyThePlansOtherEndWithTheWholeMatrixInOrder) {
  const size_t half = kBytes / 2;
  EXPECT_EQ(Push({Part(0, kBytes, 1, "stranger")}).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Push({Part(0, kBytes, 1, "w2", /*stage=*/1)}).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Push({Part(0, 8, 1, "w2", 2, /*total=*/1ull << 40)}).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Push({Part(0, half), Part(half + 1, kBytes - half - 1)}).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT)
      << "a gap";
  EXPECT_EQ(Push({Part(0, half), Part(half, kBytes - half + 1)}).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT)
      << "past the end";
  const grpc::Status short_push = Push({Part(0, half)});
  EXPECT_EQ(short_push.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(short_push.error_message().find("ended at byte"), std::string::npos);
  // The whole matrix is accepted, once, and at most one update ahead.
  EXPECT_TRUE(Push({Part(0, half, 7), Part(half, kBytes - half, 7)}).ok());
  EXPECT_EQ(Push({Part(0, kBytes, 7)}).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(Push({Part(0, kBytes, 8)}).ok());
  EXPECT_EQ(Push({Part(0, kBytes, 9)}).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

}  // namespace
}  // namespace geotrain
