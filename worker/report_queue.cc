#include "worker/report_queue.h"

#include <algorithm>

#include "common/logging.h"

namespace geotrain {

ReportQueue::ReportQueue(size_t capacity)
    : capacity_(capacity < 1 ? 1 : capacity), sender_([this] { Loop(); }) {}

ReportQueue::~ReportQueue() {
  if (!Flush(kFlushOnExit)) {
    absl::MutexLock lock(&mu_);
    GT_LOG(Warning) << pending_.size() << " progress report(s) not sent: the coordinator did "
                    << "not take them within " << absl::FormatDuration(kFlushOnExit);
  }
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    pending_.clear();
  }
  sender_.join();
}

void ReportQueue::Post(std::function<void()> send) {
  Enqueue({[send = std::move(send)] {
             send();
             return true;
           },
           absl::ZeroDuration()});
}

void ReportQueue::PostRetrying(std::function<bool()> send, absl::Duration retry_for) {
  Enqueue({std::move(send), retry_for});
}

void ReportQueue::Enqueue(Pending pending) {
  absl::MutexLock lock(&mu_);
  if (pending_.size() >= capacity_) {
    pending_.pop_front();
    if (dropped_++ == 0) {
      GT_LOG(Warning) << "the coordinator is not taking progress reports; dropping the oldest "
                      << "past " << capacity_ << " pending";
    }
  }
  pending_.push_back(std::move(pending));
}

bool ReportQueue::Flush(absl::Duration limit) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || (pending_.empty() && !sending_);
  };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), limit);
}

int64_t ReportQueue::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

void ReportQueue::Loop() {
  while (true) {
    Pending next;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !pending_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      next = std::move(pending_.front());
      pending_.pop_front();
      sending_ = true;
    }
    SendWithRetries(next);
    absl::MutexLock lock(&mu_);
    sending_ = false;
  }
}

void ReportQueue::SendWithRetries(const Pending& pending) {
  const absl::Time give_up = absl::Now() + pending.retry_for;
  absl::Duration backoff = kFirstRetry;
  while (!pending.send()) {
    if (absl::Now() + backoff > give_up) {
      GT_LOG(Warning) << "a progress report was not taken within "
                      << absl::FormatDuration(pending.retry_for) << "; going on without it";
      return;
    }
    absl::MutexLock lock(&mu_);
    auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping), backoff)) return;
    backoff = std::min(backoff * 2, kMaxRetry);
  }
}

}  // namespace geotrain
