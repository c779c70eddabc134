// Cancels blocking operations that outlive their limit: a HELLO that never
// comes, a write that a peer stops reading. The sync gRPC API has no
// per-read or per-write deadline, so a stalled stream would otherwise hold
// its thread and buffers for good; cancelling its context makes the blocked
// Read/Write return false at once.
//
// One background thread checks every 100 ms. Thread-safe. `on_stall` runs
// on that thread, under the watchdog's lock, at most once per Watch; it
// must not block (ServerContext/ClientContext::TryCancel does not).
#ifndef GEOTRAIN_WORKER_STALL_WATCHDOG_H_
#define GEOTRAIN_WORKER_STALL_WATCHDOG_H_

#include <cstdint>
#include <functional>
#include <map>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace geotrain {

class StallWatchdog {
 public:
  // Unregisters on destruction; after that `on_stall` is never called.
  class Guard {
   public:
    Guard(Guard&& other) noexcept : watchdog_(other.watchdog_), id_(other.id_) {
      other.watchdog_ = nullptr;
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    ~Guard();
    // True when the operation was cancelled for stalling.
    bool stalled() const;

   private:
    friend class StallWatchdog;
    Guard(StallWatchdog* watchdog, uint64_t id) : watchdog_(watchdog), id_(id) {}
    StallWatchdog* watchdog_;
    uint64_t id_;
  };

  StallWatchdog();
  ~StallWatchdog();
  // The process's watchdog (never destroyed).
  static StallWatchdog& Shared();

  Guard Watch(absl::Duration limit, std::function<void()> on_stall);

 private:
  struct Entry {
    absl::Time deadline;
    std::function<void()> on_stall;
    bool fired = false;
  };
  void Loop();

  mutable absl::Mutex mu_;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_STALL_WATCHDOG_H_
