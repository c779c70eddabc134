#include "coordinator/durable_state_writer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace geotrain {
namespace {

v1::CoordinatorState StateAt(int step) {
  v1::CoordinatorState state;
  state.set_step(step);
  return state;
}

TEST(DurableStateWriterTest, SubmitsDoNotWaitAndTheNewestWins) {
  absl::Notification disk_free;
  absl::Mutex mu;
  std::vector<int> written;
  std::atomic<int> started{0};
  DurableStateWriter writer([&](const v1::CoordinatorState& state) {
    ++started;
    disk_free.WaitForNotification();
    absl::MutexLock lock(&mu);
    written.push_back(state.step());
    return absl::OkStatus();
  });
  writer.Submit(StateAt(1));
  while (started == 0) absl::SleepFor(absl::Milliseconds(1));
  // The first write is stuck; these return at once and replace each other.
  for (int step = 2; step <= 50; ++step) writer.Submit(StateAt(step));
  EXPECT_EQ(writer.superseded(), 48);
  disk_free.Notify();
  writer.Flush();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(written, (std::vector<int>{1, 50}));
  EXPECT_EQ(writer.writes(), 2);
}

TEST(DurableStateWriterTest, FailuresAreNotFatalAndDestructionWritesWhatIsPending) {
  std::atomic<int> attempts{0};
  std::atomic<int> last{0};
  {
    DurableStateWriter writer([&](const v1::CoordinatorState& state) {
      last = state.step();
      return ++attempts == 1 ? absl::DataLossError("injected") : absl::OkStatus();
    });
    writer.Submit(StateAt(1));
    writer.Flush();
    writer.Submit(StateAt(2));
  }
  EXPECT_EQ(attempts.load(), 2);
  EXPECT_EQ(last.load(), 2);
}

TEST(DurableStateWriterTest, MarksCoalesceIntoOneSnapshotTakenAfterThem) {
  // The state lives with its owner; callers only mark it changed.
  std::atomic<int> step{0};
  std::atomic<int> snapshots{0};
  absl::Notification disk_free;
  std::atomic<int> started{0};
  absl::Mutex mu;
  std::vector<int> written;
  DurableStateWriter writer(
      [&](const v1::CoordinatorState& state) {
        ++started;
        disk_free.WaitForNotification();
        absl::MutexLock lock(&mu);
        written.push_back(state.step());
        return absl::OkStatus();
      },
      [&] {
        ++snapshots;
        return StateAt(step.load());
      });
  step = 1;
  writer.MarkDirty();
  while (started == 0) absl::SleepFor(absl::Milliseconds(1));
  // The first write is stuck; a thousand changes meanwhile cost no
  // snapshot until the writer's next turn, which holds the last of them.
  for (int i = 2; i <= 1000; ++i) {
    step = i;
    writer.MarkDirty();
  }
  EXPECT_EQ(snapshots.load(), 1);
  disk_free.Notify();
  writer.Flush();
  EXPECT_EQ(snapshots.load(), 2);
  absl::MutexLock lock(&mu);
  EXPECT_EQ(written, (std::vector<int>{1, 1000}));
}

TEST(DurableStateWriterTest, FlushWithNothingSubmittedReturns) {
  DurableStateWriter writer([](const v1::CoordinatorState&) { return absl::OkStatus(); });
  writer.Flush();
  EXPECT_EQ(writer.writes(), 0);
}

}  // namespace
}  // namespace geotrain
