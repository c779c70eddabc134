#include "coordinator/plan_publisher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "coordinator/coordinator_store.h"

namespace geotrain {
namespace {

v1::Plan PlanOf(uint64_t epoch) {
  v1::Plan plan;
  plan.set_epoch(epoch);
  return plan;
}

// An in-memory store whose plan writes wait for the test, or fail.
class GatedStore : public InMemoryCoordinatorStore {
 public:
  absl::Status WritePlan(const v1::Plan& plan) override {
    ++attempts;
    while (stall) absl::SleepFor(absl::Milliseconds(1));
    if (fail) return absl::UnavailableError("disk full (injected)");
    return InMemoryCoordinatorStore::WritePlan(plan);
  }
  uint64_t DurableEpoch() const {
    absl::StatusOr<std::optional<v1::Plan>> plan = ReadPlan();
    return plan.ok() && plan->has_value() ? (*plan)->epoch() : 0;
  }
  std::atomic<bool> stall{false};
  std::atomic<bool> fail{false};
  std::atomic<int> attempts{0};
};

PlanPublisherOptions OptionsFor(CoordinatorStore* store) {
  PlanPublisherOptions options;
  options.store = store;
  options.retry_initial = absl::Milliseconds(5);
  options.retry_max = absl::Milliseconds(20);
  return options;
}

TEST(PlanPublisherTest, APlanIsNeverVisibleBeforeItIsDurable) {
  GatedStore store;
  // Every visible plan is checked against the store when it appears.
  std::atomic<int> seen{0};
  std::atomic<int> not_durable{0};
  PlanPublisher publisher(OptionsFor(&store));
  publisher.AddListener([&](const PlanPublisher::PlanPtr& plan) {
    ++seen;
    if (store.DurableEpoch() < plan->epoch()) ++not_durable;
  });
  store.stall = true;
  publisher.Submit(PlanOf(1));
  while (store.attempts == 0) absl::SleepFor(absl::Milliseconds(1));
  // The write is stuck: nobody sees the plan.
  EXPECT_EQ(publisher.Visible(), nullptr);
  EXPECT_EQ(publisher.WaitForNewer(0, absl::Milliseconds(50)), nullptr);
  EXPECT_EQ(store.DurableEpoch(), 0u);
  store.stall = false;
  PlanPublisher::PlanPtr plan = publisher.WaitForNewer(0, absl::Seconds(10));
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(plan->epoch(), 1u);
  EXPECT_EQ(store.DurableEpoch(), 1u);
  for (uint64_t epoch = 2; epoch <= 20; ++epoch) publisher.Submit(PlanOf(epoch));
  publisher.Flush();
  EXPECT_EQ(publisher.Visible()->epoch(), 20u);
  EXPECT_GE(seen.load(), 2);
  EXPECT_EQ(not_durable.load(), 0);
}

TEST(PlanPublisherTest, SubmitsDoNotWaitForTheStoreAndTheNewestWins) {
  GatedStore store;
  std::vector<uint64_t> visible;
  absl::Mutex mu;
  PlanPublisher publisher(OptionsFor(&store));
  publisher.AddListener([&](const PlanPublisher::PlanPtr& plan) {
    absl::MutexLock lock(&mu);
    visible.push_back(plan->epoch());
  });
  store.stall = true;
  publisher.Submit(PlanOf(1));
  while (store.attempts == 0) absl::SleepFor(absl::Milliseconds(1));
  const absl::Time start = absl::Now();
  for (uint64_t epoch = 2; epoch <= 50; ++epoch) publisher.Submit(PlanOf(epoch));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));  // the store is stuck throughout
  EXPECT_EQ(publisher.superseded(), 48);  // 2..49 never had their turn
  store.stall = false;
  publisher.Flush();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(visible, (std::vector<uint64_t>{1, 50}));
  EXPECT_EQ(publisher.published(), 2);
}

TEST(PlanPublisherTest, ARefusedWriteIsRetriedAndTheOldPlanStaysMeanwhile) {
  GatedStore store;
  PlanPublisher publisher(OptionsFor(&store));
  publisher.Submit(PlanOf(1));
  publisher.Flush();
  store.fail = true;
  publisher.Submit(PlanOf(2));
  while (publisher.write_failures() < 3) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(publisher.Visible()->epoch(), 1u);
  EXPECT_EQ(publisher.WaitForNewer(1, absl::Milliseconds(20)), nullptr);
  store.fail = false;
  ASSERT_NE(publisher.WaitForNewer(1, absl::Seconds(10)), nullptr);
  EXPECT_EQ(store.DurableEpoch(), 2u);
}

TEST(PlanPublisherTest, BeforeWriteRunsFirstAndRestoreNeedsNoWrite) {
  GatedStore store;
  std::atomic<int> before{0};
  std::atomic<int> attempts_at_before{-1};
  PlanPublisherOptions options = OptionsFor(&store);
  options.before_write = [&] {
    ++before;
    attempts_at_before = store.attempts.load();
  };
  PlanPublisher publisher(options);
  publisher.Restore(PlanOf(7));
  EXPECT_EQ(publisher.Visible()->epoch(), 7u);
  EXPECT_EQ(publisher.WaitForNewer(6, absl::ZeroDuration())->epoch(), 7u);
  EXPECT_EQ(store.attempts.load(), 0);
  publisher.Submit(PlanOf(8));
  publisher.Flush();
  EXPECT_EQ(before.load(), 1);
  EXPECT_EQ(attempts_at_before.load(), 0);  // before the plan's write
  EXPECT_EQ(publisher.Visible()->epoch(), 8u);
}

TEST(PlanPublisherTest, ShutdownWakesWatchers) {
  GatedStore store;
  PlanPublisher publisher(OptionsFor(&store));
  std::atomic<bool> returned{false};
  std::thread watcher([&] {
    EXPECT_EQ(publisher.WaitForNewer(0, absl::Seconds(60)), nullptr);
    returned = true;
  });
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(returned.load());
  publisher.Shutdown();
  watcher.join();
  EXPECT_TRUE(returned.load());
  EXPECT_EQ(publisher.WaitForNewer(0, absl::Seconds(60)), nullptr);  // at once
}

}  // namespace
}  // namespace geotrain
