// A blocking FIFO with a capacity: Push waits while full (back-pressure),
// Pop waits while empty. Close() wakes everyone; afterwards Push fails and
// Pop drains what is left, then fails. Thread-safe.
#ifndef GEOTRAIN_COMMON_BOUNDED_QUEUE_H_
#define GEOTRAIN_COMMON_BOUNDED_QUEUE_H_

#include <deque>
#include <optional>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace geotrain {

template <typename T>
class BoundedQueue {
 public:
  explicit BoundedQueue(size_t capacity) : capacity_(capacity) {}

  // False when the queue was closed (the item is dropped).
  bool Push(T item) {
    absl::MutexLock lock(&mu_);
    auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return closed_ || items_.size() < capacity_;
    };
    mu_.Await(absl::Condition(&room));
    if (closed_) return false;
    items_.push_back(std::move(item));
    return true;
  }

  // Push without waiting: false when full or closed.
  bool TryPush(T item) {
    absl::MutexLock lock(&mu_);
    if (closed_ || items_.size() >= capacity_) return false;
    items_.push_back(std::move(item));
    return true;
  }

  // nullopt when closed and empty, or when `timeout` passed first.
  std::optional<T> Pop(absl::Duration timeout = absl::InfiniteDuration()) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return closed_ || !items_.empty();
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    if (items_.empty()) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }

  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  bool closed() const {
    absl::MutexLock lock(&mu_);
    return closed_;
  }

  size_t size() const {
    absl::MutexLock lock(&mu_);
    return items_.size();
  }

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<T> items_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_BOUNDED_QUEUE_H_
