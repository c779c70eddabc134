#include "worker/commitment_log.h"

#include <gtest/gtest.h>

#include "common/commitment.h"

namespace geotrain {
namespace {

using Direction = CommitmentLog::Direction;

LinkMessage Message(v1::MessageKind kind, uint64_t microbatch, size_t bytes,
                    uint64_t epoch = 3) {
  LinkMessage m;
  m.header.set_kind(kind);
  m.header.set_epoch(epoch);
  m.header.set_microbatch(microbatch);
  m.header.set_step(static_cast<int>(microbatch / 4) + 1);
  m.header.set_weight_version(7);
  m.payload.assign(bytes, static_cast<char>('a' + microbatch % 26));
  m.header.set_commitment(CommitmentOf(m.header, m.payload));
  return m;
}

TEST(CommitmentLogTest, FindsWhatWasReceivedAndSentByMicrobatch) {
  CommitmentLogOptions options;
  options.max_payload_bytes = 1 << 20;
  CommitmentLog log(options);
  const absl::Time at = absl::FromUnixSeconds(100);
  const LinkMessage received = Message(v1::MESSAGE_KIND_ACTIVATION, 5, 64);
  log.RecordReceived(received, "w-up", at);
  log.RecordSent(Message(v1::MESSAGE_KIND_GRADIENT, 5, 32), at);
  // Not training traffic: nothing to commit to, nothing logged.
  LinkMessage done;
  done.header.set_kind(v1::MESSAGE_KIND_DONE);
  log.RecordReceived(done, "w-up", at);

  std::optional<LoggedMessage> got =
      log.Find(Direction::kReceived, v1::MESSAGE_KIND_ACTIVATION, 3, 5);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->peer, "w-up");
  EXPECT_EQ(got->commitment, received.header.commitment());
  EXPECT_EQ(got->weight_version, 7);
  EXPECT_EQ(got->step, 2);
  EXPECT_EQ(got->payload_bytes, 64u);
  EXPECT_EQ(got->message, nullptr) << "a receiver keeps the commitment, not the bytes";
  std::optional<LoggedMessage> sent = log.Find(Direction::kSent, v1::MESSAGE_KIND_GRADIENT, 3, 5);
  ASSERT_TRUE(sent.has_value());
  ASSERT_NE(sent->message, nullptr);
  EXPECT_TRUE(CheckCommitment(sent->message->header, sent->message->payload).ok());
  // Another epoch, kind or direction is another entry.
  EXPECT_FALSE(log.Find(Direction::kReceived, v1::MESSAGE_KIND_ACTIVATION, 4, 5).has_value());
  EXPECT_FALSE(log.Find(Direction::kReceived, v1::MESSAGE_KIND_GRADIENT, 3, 5).has_value());
  EXPECT_FALSE(log.Find(Direction::kSent, v1::MESSAGE_KIND_ACTIVATION, 3, 5).has_value());
  EXPECT_EQ(log.entries(Direction::kReceived), 1u);
}

// However much a worker trains, the log holds a bounded number of entries
// and of bytes: the oldest go first, and the oldest sent messages lose
// their bytes before their commitments.
TEST(CommitmentLogTest, MemoryIsBoundedOldestFirst) {
  CommitmentLogOptions options;
  options.max_entries = 100;
  options.max_payload_bytes = 10 * 1000;
  CommitmentLog log(options);
  const absl::Time at = absl::FromUnixSeconds(100);
  for (uint64_t mb = 0; mb < 1000; ++mb) {
    log.RecordReceived(Message(v1::MESSAGE_KIND_ACTIVATION, mb, 10), "w-up", at);
    log.RecordSent(Message(v1::MESSAGE_KIND_ACTIVATION, mb, 1000), at);
    ASSERT_LE(log.entries(Direction::kReceived), 100u);
    ASSERT_LE(log.entries(Direction::kSent), 100u);
    ASSERT_LE(log.kept_payload_bytes(), 10u * 1000);
  }
  EXPECT_FALSE(log.Find(Direction::kReceived, v1::MESSAGE_KIND_ACTIVATION, 3, 899).has_value());
  EXPECT_TRUE(log.Find(Direction::kReceived, v1::MESSAGE_KIND_ACTIVATION, 3, 900).has_value());
  // The newest ten sent messages keep their bytes; the 90 before only
  // their commitments.
  std::optional<LoggedMessage> old = log.Find(Direction::kSent, v1::MESSAGE_KIND_ACTIVATION, 3, 980);
  ASSERT_TRUE(old.has_value());
  EXPECT_EQ(old->message, nullptr);
  EXPECT_EQ(old->commitment.size(), kCommitmentBytes);
  std::optional<LoggedMessage> kept = log.Find(Direction::kSent, v1::MESSAGE_KIND_ACTIVATION, 3, 990);
  ASSERT_TRUE(kept.has_value());
  ASSERT_NE(kept->message, nullptr);
  EXPECT_EQ(kept->message->payload, std::string(1000, static_cast<char>('a' + 990 % 26)));
  EXPECT_EQ(log.kept_payload_bytes(), 10u * 1000);
  // A message larger than the whole bound keeps only its commitment.
  log.RecordSent(Message(v1::MESSAGE_KIND_GRADIENT, 1, 20 * 1000), at);
  std::optional<LoggedMessage> big = log.Find(Direction::kSent, v1::MESSAGE_KIND_GRADIENT, 3, 1);
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(big->message, nullptr);
  EXPECT_EQ(log.kept_payload_bytes(), 10u * 1000);
}

// A microbatch sent again (a replay after a re-plan, in the same epoch)
// finds the newest entry; evicting the older one keeps the newer findable.
// By default a worker keeps the commitments of what it sent, not the bytes.
TEST(CommitmentLogTest, NoBytesAreKeptByDefault) {
  CommitmentLog log;
  LinkMessage message;
  message.header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  message.header.set_microbatch(3);
  message.payload = std::string(1000, 'x');
  message.header.set_commitment(CommitmentOf(message.header, message.payload));
  log.RecordSent(message, absl::Now());
  auto sent = log.Find(Direction::kSent, v1::MESSAGE_KIND_ACTIVATION, 0, 3);
  ASSERT_TRUE(sent.has_value());
  EXPECT_EQ(sent->commitment, message.header.commitment());
  EXPECT_EQ(sent->message, nullptr);
  EXPECT_EQ(log.kept_payload_bytes(), 0u);
}

TEST(CommitmentLogTest, TheNewestEntryOfAMicrobatchWins) {
  CommitmentLogOptions options;
  options.max_entries = 3;
  CommitmentLog log(options);
  const absl::Time at = absl::FromUnixSeconds(100);
  LinkMessage first = Message(v1::MESSAGE_KIND_ACTIVATION, 1, 8);
  LinkMessage again = Message(v1::MESSAGE_KIND_ACTIVATION, 1, 9);
  log.RecordReceived(first, "w-a", at);
  log.RecordReceived(again, "w-b", at);
  EXPECT_EQ(log.Find(Direction::kReceived, v1::MESSAGE_KIND_ACTIVATION, 3, 1)->peer, "w-b");
  log.RecordReceived(Message(v1::MESSAGE_KIND_ACTIVATION, 2, 8), "w-a", at);
  log.RecordReceived(Message(v1::MESSAGE_KIND_ACTIVATION, 3, 8), "w-a", at);  // evicts `first`
  std::optional<LoggedMessage> got = log.Find(Direction::kReceived, v1::MESSAGE_KIND_ACTIVATION, 3, 1);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->commitment, again.header.commitment());
}

// A spot check names a microbatch, not the links' epoch: the newest entry
// of any epoch answers; a bound set later keeps bytes from then on.
TEST(CommitmentLogTest, FindsTheNewestOfAnyEpochAndTakesABoundLater) {
  CommitmentLog log;
  const absl::Time at = absl::FromUnixSeconds(100);
  log.RecordSent(Message(v1::MESSAGE_KIND_GRADIENT, 4, 100, /*epoch=*/2), at);
  EXPECT_EQ(log.FindNewest(Direction::kSent, v1::MESSAGE_KIND_GRADIENT, 4)->message, nullptr);
  log.SetMaxPayloadBytes(250);
  const LinkMessage newer = Message(v1::MESSAGE_KIND_GRADIENT, 4, 100, /*epoch=*/5);
  log.RecordSent(newer, at);
  std::optional<LoggedMessage> got = log.FindNewest(Direction::kSent, v1::MESSAGE_KIND_GRADIENT, 4);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->epoch, 5u);
  ASSERT_NE(got->message, nullptr);
  EXPECT_EQ(got->message->payload, newer.payload);
  EXPECT_FALSE(log.FindNewest(Direction::kSent, v1::MESSAGE_KIND_ACTIVATION, 4).has_value());
  EXPECT_FALSE(log.FindNewest(Direction::kReceived, v1::MESSAGE_KIND_GRADIENT, 4).has_value());
  // Three more: only the newest two keep their bytes under 250.
  for (uint64_t mb = 5; mb < 8; ++mb) log.RecordSent(Message(v1::MESSAGE_KIND_GRADIENT, mb, 100), at);
  EXPECT_EQ(log.kept_payload_bytes(), 200u);
  EXPECT_EQ(log.FindNewest(Direction::kSent, v1::MESSAGE_KIND_GRADIENT, 4)->message, nullptr);
  EXPECT_NE(log.FindNewest(Direction::kSent, v1::MESSAGE_KIND_GRADIENT, 7)->message, nullptr);
  // A smaller bound drops bytes at once.
  log.SetMaxPayloadBytes(100);
  EXPECT_EQ(log.kept_payload_bytes(), 100u);
}

}  // namespace
}  // namespace geotrain
