#include "coordinator/accusation_ledger.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

WorkerRecord Member(const std::string& id, bool alive, int64_t last_heartbeat_ms) {
  WorkerRecord w;
  w.id = id;
  w.alive = alive;
  w.last_heartbeat_ms = last_heartbeat_ms;
  return w;
}

TEST(AccusationLedgerTest, OneAccusationPerLease) {
  AccusationLedger ledger(1000);
  ASSERT_TRUE(ledger.MayAccuse("a", "b", 0).ok());
  ledger.Record("a", "b", 0);
  const absl::Status again = ledger.MayAccuse("a", "c", 999);
  EXPECT_EQ(again.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(again.message().find("one accusation per worker per lease"), std::string::npos);
  EXPECT_TRUE(ledger.MayAccuse("a", "c", 1000).ok());
  EXPECT_TRUE(ledger.MayAccuse("d", "c", 500).ok());  // per accuser
}

TEST(AccusationLedgerTest, AnAccuserWhoseAccusedKeepHeartbeatingIsSuspected) {
  AccusationLedger ledger(1000);
  ledger.Record("liar", "b", 0);
  // Not settled before two leases.
  EXPECT_TRUE(ledger.Review({Member("b", true, 1900)}, 1999, true).empty());
  EXPECT_TRUE(ledger.Review({Member("b", true, 1900)}, 2000, true).empty());  // 1 unconfirmed
  EXPECT_FALSE(ledger.SuspicionOf("liar").has_value());
  ledger.Record("liar", "c", 3000);
  const auto newly = ledger.Review({Member("c", true, 4500)}, 5000, true);
  ASSERT_EQ(newly.size(), 1u);
  EXPECT_EQ(newly[0].accuser, "liar");
  ASSERT_TRUE(ledger.SuspicionOf("liar").has_value());
  EXPECT_NE(ledger.SuspicionOf("liar")->find("2 of its link_lost accusations"), std::string::npos);
  const absl::Status refused = ledger.MayAccuse("liar", "d", 10000);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(refused.message().find("the accuser is suspected"), std::string::npos);
}

TEST(AccusationLedgerTest, ConfirmedOrUnauthenticatedAccusationsCountForNothing) {
  AccusationLedger ledger(1000);
  for (int i = 0; i < 3; ++i) {
    const int64_t t = 10000 * i;
    ledger.Record("a", "gone", t);
    EXPECT_TRUE(ledger.Review({Member("gone", false, t)}, t + 1, true).empty());  // confirmed
  }
  for (int i = 0; i < 3; ++i) {
    const int64_t t = 100000 + 10000 * i;
    ledger.Record("a", "b", t);
    // Callers unauthenticated: anyone could forge "a", so nothing counts.
    EXPECT_TRUE(ledger.Review({Member("b", true, t + 1900)}, t + 2000, false).empty());
  }
  EXPECT_FALSE(ledger.SuspicionOf("a").has_value());
}

}  // namespace
}  // namespace geotrain
