// The relay's pairing rules against real TCP connections on loopback: only
// ends with their side's proof are paired, a waiting end is never displaced
// by a second one with the same secrets, and a spliced pair stays.
#include "relay/splice_relay.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

constexpr char kRendezvous[] = "0123456789abcdef0123456789abcdef";
constexpr char kUpProof[] = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
constexpr char kDownProof[] = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

class SpliceRelayTest : public testing::Test {
 protected:
  void SetUp() override {
    SpliceRelayOptions options;
    options.listen = "127.0.0.1:0";
    options.pair_timeout = absl::Seconds(3);
    options.unknown_rendezvous_wait = absl::Milliseconds(200);
    auto relay = SpliceRelay::Start(options);
    ASSERT_TRUE(relay.ok()) << relay.status();
    relay_ = *std::move(relay);
    relay_->SetLinks({{kRendezvous, {kUpProof, kDownProof}}});
  }

  // A connection that has sent its greeting.
  TcpSocket Greet(const std::string& side, const std::string& proof,
                  const std::string& rendezvous = kRendezvous) {
    auto socket = TcpSocket::Connect(absl::StrCat("127.0.0.1:", relay_->port()), absl::Seconds(5));
    EXPECT_TRUE(socket.ok()) << socket.status();
    const std::string line = absl::StrCat("GTRELAY1 ", rendezvous, " ", side, " ", proof, "\n");
    EXPECT_TRUE(socket->WriteAll(line.data(), line.size()));
    return *std::move(socket);
  }
  static std::string Answer(TcpSocket& socket) {
    absl::StatusOr<std::string> line = socket.ReadLine(512, absl::Now() + absl::Seconds(10));
    return line.ok() ? *line : absl::StrCat("(", line.status().message(), ")");
  }
  // Waits until the relay has `n` ends waiting.
  void WaitForWaiting(int n) {
    for (int i = 0; i < 500 && relay_->stats().waiting != n; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_EQ(relay_->stats().waiting, n);
  }

  std::unique_ptr<SpliceRelay> relay_;
};

TEST_F(SpliceRelayTest, OnlyEndsWithTheirOwnProofArePaired) {
  TcpSocket wrong = Greet("up", kDownProof);  // the other end's proof
  EXPECT_EQ(Answer(wrong), "ERR wrong proof for the up end of that link");
  TcpSocket unknown = Greet("up", kUpProof, std::string(32, 'f'));
  EXPECT_NE(Answer(unknown).find("no link of the current plan"), std::string::npos);
  TcpSocket old_greeting = [&] {
    auto s = TcpSocket::Connect(absl::StrCat("127.0.0.1:", relay_->port()), absl::Seconds(5));
    const std::string line = absl::StrCat("GTRELAY1 ", kRendezvous, " up\n");
    s->WriteAll(line.data(), line.size());
    return *std::move(s);
  }();
  EXPECT_NE(Answer(old_greeting).find("ERR expected"), std::string::npos);

  TcpSocket up = Greet("up", kUpProof);
  WaitForWaiting(1);
  TcpSocket down = Greet("down", kDownProof);
  EXPECT_EQ(Answer(up), "OK");
  EXPECT_EQ(Answer(down), "OK");
  const std::string hello = "spliced\n";
  ASSERT_TRUE(up.WriteAll(hello.data(), hello.size()));
  EXPECT_EQ(Answer(down), "spliced");
}

// Issue 32: a second holder of a worker's secrets displaced the real end
// ("newest wins") and training made no step.
TEST_F(SpliceRelayTest, AWaitingEndIsNotDisplacedAndAPairStaysPaired) {
  TcpSocket first = Greet("up", kUpProof);
  WaitForWaiting(1);
  TcpSocket second = Greet("up", kUpProof);
  EXPECT_NE(Answer(second).find("already waiting here"), std::string::npos);
  TcpSocket down = Greet("down", kDownProof);
  EXPECT_EQ(Answer(first), "OK");
  EXPECT_EQ(Answer(down), "OK");
  // The pair is spliced; more ends of the same link find no partner.
  TcpSocket third = Greet("down", kDownProof);
  EXPECT_NE(Answer(third).find("did not arrive"), std::string::npos);
  const std::string bytes = "still paired\n";
  ASSERT_TRUE(down.WriteAll(bytes.data(), bytes.size()));
  EXPECT_EQ(Answer(first), "still paired");
}

TEST_F(SpliceRelayTest, AnEndWhoseConnectionClosedIsReplacedByItsReconnection) {
  {
    TcpSocket first = Greet("up", kUpProof);
    WaitForWaiting(1);
  }  // closed while it waits (its worker restarted)
  TcpSocket again = Greet("up", kUpProof);
  TcpSocket down = Greet("down", kDownProof);
  EXPECT_EQ(Answer(again), "OK");
  EXPECT_EQ(Answer(down), "OK");
}

}  // namespace
}  // namespace geotrain
