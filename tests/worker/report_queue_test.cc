// ReportQueue: reports go out in order from another thread, posting never
// waits on a slow send, the queue is bounded, and Flush waits for the rest.
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

}  // namespace
}  // namespace geotrain
