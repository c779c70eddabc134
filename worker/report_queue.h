// Sends a worker's progress reports (step and evaluation results) from a
// background thread, in the order they were posted, so the pipeline driver
// never waits on the coordinator: over a WAN each unary report costs a round
// trip, and a slow or unreachable coordinator would stall every step.
//
// Bounded: past `capacity` pending reports the oldest is dropped (and
// counted), so a coordinator that is gone costs memory for `capacity`
// reports at most. Flush() waits for what is pending (before DONE, so the
// coordinator has every step first). A report posted with PostRetrying is
// sent again, in its place, while the coordinator cannot take it yet.
// Thread-safe.
#ifndef GEOTRAIN_WORKER_REPORT_QUEUE_H_
#define GEOTRAIN_WORKER_REPORT_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace geotrain {

class ReportQueue {
 public:
  explicit ReportQueue(size_t capacity = 1024);
  // Flushes for up to `kFlushOnExit`, then drops what is left.
  ~ReportQueue();
  ReportQueue(const ReportQueue&) = delete;
  ReportQueue& operator=(const ReportQueue&) = delete;

  static constexpr absl::Duration kFlushOnExit = absl::Seconds(5);

  // Queues `send` (one report's RPC, with its own deadline) and returns.
  void Post(std::function<void()> send);
  // Queues a report the coordinator may not take yet: `send` returns false
  // to be sent again (the coordinator is making a new plan, or restarting).
  // Retried after kFirstRetry, doubling up to kMaxRetry, for `retry_for` at
  // most; the reports posted after it wait, so the order holds. Stopping
  // (destruction) ends the retries.
  void PostRetrying(std::function<bool()> send, absl::Duration retry_for);
  static constexpr absl::Duration kFirstRetry = absl::Milliseconds(50);
  static constexpr absl::Duration kMaxRetry = absl::Seconds(1);
  // Waits until every report posted so far has been sent (or has failed);
  // false if `limit` passed first.
  bool Flush(absl::Duration limit);
  int64_t dropped() const;

 private:
  struct Pending {
    std::function<bool()> send;  // false: send it again
    absl::Duration retry_for;
  };
  void Loop();
  void Enqueue(Pending pending);
  // Sends `pending` until it is taken, its time runs out or the queue stops.
  void SendWithRetries(const Pending& pending);

  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool sending_ ABSL_GUARDED_BY(mu_) = false;  // one is out of the queue, in flight
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sender_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_REPORT_QUEUE_H_
