#include "worker/stall_watchdog.h"

namespace geotrain {

StallWatchdog::StallWatchdog() : thread_([this] { Loop(); }) {}

StallWatchdog::~StallWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

StallWatchdog& StallWatchdog::Shared() {
  static StallWatchdog* watchdog = new StallWatchdog();
  return *watchdog;
}

StallWatchdog::Guard StallWatchdog::Watch(absl::Duration limit, std::function<void()> on_stall) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  entries_[id] = Entry{absl::Now() + limit, std::move(on_stall)};
  return Guard(this, id);
}

StallWatchdog::Guard::~Guard() {
  if (watchdog_ == nullptr) return;
  absl::MutexLock lock(&watchdog_->mu_);
  watchdog_->entries_.erase(id_);
}

bool StallWatchdog::Guard::stalled() const {
  if (watchdog_ == nullptr) return false;
  absl::MutexLock lock(&watchdog_->mu_);
  auto it = watchdog_->entries_.find(id_);
  return it != watchdog_->entries_.end() && it->second.fired;
}

void StallWatchdog::Loop() {
  absl::MutexLock lock(&mu_);
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Milliseconds(100))) {
    const absl::Time now = absl::Now();
    for (auto& [id, entry] : entries_) {
      if (!entry.fired && now >= entry.deadline) {
        entry.fired = true;
        entry.on_stall();
      }
    }
  }
}

}  // namespace geotrain
