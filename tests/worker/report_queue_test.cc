// ReportQueue: reports go out in order from another thread, posting never
// waits on a slow send, the queue is bounded, Flush waits for the rest, and
// a report the coordinator cannot take yet is retried in its place.
#include "worker/report_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace geotrain {
namespace {

TEST(ReportQueueTest, ReportsGoOutInOrderFromAnotherThread) {
  absl::Mutex mu;
  std::vector<int> sent;
  std::thread::id sender;
  {
    ReportQueue queue;
    for (int i = 0; i < 50; ++i) {
      queue.Post([&, i] {
        absl::MutexLock lock(&mu);
        sent.push_back(i);
        sender = std::this_thread::get_id();
      });
    }
    EXPECT_TRUE(queue.Flush(absl::Seconds(10)));
    absl::MutexLock lock(&mu);
    ASSERT_EQ(sent.size(), 50u);
    for (int i = 0; i < 50; ++i) EXPECT_EQ(sent[i], i);
    EXPECT_NE(sender, std::this_thread::get_id());
    EXPECT_EQ(queue.dropped(), 0);
  }
}

// A coordinator that takes a second per report (a stalled RPC) costs the
// poster nothing; Flush waits for it, and reports that cannot all be kept
// lose the oldest.
TEST(ReportQueueTest, ASlowSendNeverBlocksThePosterAndTheQueueIsBounded) {
  absl::Notification started, release;
  std::atomic<int> sent{0};
  std::atomic<int> last{-1};
  ReportQueue queue(/*capacity=*/4);
  const absl::Time start = absl::Now();
  for (int i = 0; i < 20; ++i) {
    queue.Post([&, i] {
      if (i == 0) started.Notify();
      release.WaitForNotification();
      ++sent;
      last = i;
    });
    if (i == 0) started.WaitForNotification();  // the first is in flight, stalled
  }
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500)) << "posting waited on the send";
  EXPECT_FALSE(queue.Flush(absl::Milliseconds(100))) << "the first send is still stalled";
  release.Notify();
  EXPECT_TRUE(queue.Flush(absl::Seconds(10)));
  // The first went out before the stall; 4 of the rest were kept (the newest).
  EXPECT_EQ(sent.load(), 5);
  EXPECT_EQ(last.load(), 19);
  EXPECT_EQ(queue.dropped(), 15);
}

TEST(ReportQueueTest, DestructionSendsWhatIsPending) {
  std::atomic<int> sent{0};
  {
    ReportQueue queue;
    for (int i = 0; i < 10; ++i) {
      queue.Post([&] {
        absl::SleepFor(absl::Milliseconds(5));
        ++sent;
      });
    }
  }
  EXPECT_EQ(sent.load(), 10);
}

// A report the coordinator cannot take yet (a plan being made) is sent
// again until it is taken, and the reports after it wait their turn: the
// coordinator sees them in the order they were posted.
TEST(ReportQueueTest, ARefusedReportIsSentAgainBeforeTheNextOne) {
  absl::Mutex mu;
  std::vector<int> taken;
  int refusals_left = 3;
  ReportQueue queue;
  queue.PostRetrying(
      [&] {
        absl::MutexLock lock(&mu);
        if (refusals_left > 0) {
          --refusals_left;
          return false;
        }
        taken.push_back(1);
        return true;
      },
      absl::Seconds(30));
  queue.Post([&] {
    absl::MutexLock lock(&mu);
    taken.push_back(2);
  });
  ASSERT_TRUE(queue.Flush(absl::Seconds(10)));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(refusals_left, 0);
  EXPECT_EQ(taken, (std::vector<int>{1, 2}));
}

// Retries are bounded by their time, and destruction ends them at once.
TEST(ReportQueueTest, RetriesEndWhenTheirTimeIsUpOrTheQueueStops) {
  std::atomic<int> tries{0};
  std::atomic<bool> next_sent{false};
  {
    ReportQueue queue;
    queue.PostRetrying([&] { return ++tries, false; }, absl::Milliseconds(200));
    queue.Post([&] { next_sent = true; });
    ASSERT_TRUE(queue.Flush(absl::Seconds(10)));
    EXPECT_TRUE(next_sent.load()) << "the report after a given-up one was not sent";
    EXPECT_GE(tries.load(), 2);
    EXPECT_LE(tries.load(), 5);  // 50 + 100 ms of backoff fit in 200 ms; 200 more do not
  }
  std::atomic<int> endless{0};
  const absl::Time start = absl::Now();
  {
    ReportQueue queue;
    queue.PostRetrying([&] { return ++endless, false; }, absl::Hours(1));
    while (endless.load() == 0) absl::SleepFor(absl::Milliseconds(1));
  }
  // Destruction flushes for kFlushOnExit, then stops the retries.
  EXPECT_LT(absl::Now() - start, ReportQueue::kFlushOnExit + absl::Seconds(3));
}

}  // namespace
}  // namespace geotrain
