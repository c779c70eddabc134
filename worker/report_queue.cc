#include "worker/report_queue.h"

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
  absl::MutexLock lock(&mu_);
  if (pending_.size() >= capacity_) {
    pending_.pop_front();
    if (dropped_++ == 0) {
      GT_LOG(Warning) << "the coordinator is not taking progress reports; dropping the oldest "
                      << "past " << capacity_ << " pending";
    }
  }
  pending_.push_back(std::move(send));
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
    std::function<void()> send;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !pending_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      send = std::move(pending_.front());
      pending_.pop_front();
      sending_ = true;
    }
    send();
    absl::MutexLock lock(&mu_);
    sending_ = false;
  }
}

}  // namespace geotrain
