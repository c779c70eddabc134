#include "coordinator/link_fault_ledger.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

constexpr int64_t kLeaseMs = 1000;

TEST(LinkFaultLedgerTest, OneIncidentPerLinkAndEpoch) {
  LinkFaultLedger ledger(kLeaseMs);
  std::optional<LinkFaultLedger::Verdict> first = ledger.Report("a", "b", 1, 0);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->take_out, "b") << "an even record: the accused";
  EXPECT_FALSE(first->exclude);
  EXPECT_FALSE(ledger.Report("b", "a", 1, 10).has_value()) << "the other end, same break";
  EXPECT_FALSE(ledger.Report("a", "b", 1, 20).has_value()) << "the same end again";
  EXPECT_TRUE(ledger.Report("a", "b", 2, 30).has_value()) << "a new epoch's break";
}

TEST(LinkFaultLedgerTest, TheCommonEndOfRepeatedBreaksIsExcludedWhoeverReports) {
  // A bad worker that accuses its neighbours...
  LinkFaultLedger accusing(kLeaseMs);
  EXPECT_EQ(accusing.Report("bad", "n1", 1, 0)->take_out, "n1");
  std::optional<LinkFaultLedger::Verdict> second = accusing.Report("bad", "n2", 2, 100);
  EXPECT_EQ(second->take_out, "bad");
  EXPECT_TRUE(second->exclude);
  EXPECT_TRUE(accusing.ExclusionOf("bad", 200).has_value());
  EXPECT_FALSE(accusing.ExclusionOf("n1", 200).has_value());
  EXPECT_FALSE(accusing.ExclusionOf("n2", 200).has_value());
  // ... or one whose links its neighbours see break: the same.
  LinkFaultLedger dropping(kLeaseMs);
  EXPECT_EQ(dropping.Report("n1", "bad", 1, 0)->take_out, "bad");
  second = dropping.Report("n2", "bad", 2, 100);
  EXPECT_EQ(second->take_out, "bad");
  EXPECT_TRUE(second->exclude);
  EXPECT_NE(second->why.find("bad in 2"), std::string::npos) << second->why;
}

TEST(LinkFaultLedgerTest, TheRecordClearsAfterTheWindow) {
  LinkFaultLedger ledger(kLeaseMs);
  ledger.Report("bad", "n1", 1, 0);
  ledger.Report("bad", "n2", 2, 0);
  const int64_t window = LinkFaultLedger::kWindowLeases * kLeaseMs;
  EXPECT_TRUE(ledger.ExclusionOf("bad", window).has_value());
  EXPECT_FALSE(ledger.ExclusionOf("bad", window + 1).has_value());
  // A fresh break after that is judged on a clean record.
  EXPECT_EQ(ledger.Report("n3", "bad", 3, window + 2)->take_out, "bad");
  EXPECT_FALSE(ledger.ExclusionOf("bad", window + 3).has_value());
}

TEST(LinkFaultLedgerTest, TheSamePairBrokenAgainTakesOutTheOtherEndForGood) {
  LinkFaultLedger ledger(kLeaseMs);
  EXPECT_EQ(ledger.Report("a", "b", 1, 0)->take_out, "b");
  // Nothing tells them apart (2 and 2), but the plan must not churn: the
  // reporter leaves this time, and stays out.
  std::optional<LinkFaultLedger::Verdict> again = ledger.Report("a", "b", 2, 10);
  EXPECT_EQ(again->take_out, "a");
  EXPECT_TRUE(again->exclude);
  EXPECT_TRUE(ledger.ExclusionOf("a", 20).has_value());
  EXPECT_FALSE(ledger.ExclusionOf("b", 20).has_value());
}

}  // namespace
}  // namespace geotrain
