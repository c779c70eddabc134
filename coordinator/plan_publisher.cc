#include "coordinator/plan_publisher.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"

namespace geotrain {

PlanPublisher::PlanPublisher(PlanPublisherOptions options)
    : options_(std::move(options)), thread_([this] { Run(); }) {}

PlanPublisher::~PlanPublisher() {
  Shutdown();
  thread_.join();
}

void PlanPublisher::Restore(v1::Plan plan) {
  absl::MutexLock lock(&mu_);
  visible_ = std::make_shared<const v1::Plan>(std::move(plan));
  changed_.SignalAll();
}

void PlanPublisher::Submit(v1::Plan plan) {
  absl::MutexLock lock(&mu_);
  // A plan still waiting for its turn is replaced; one being written is
  // not (it becomes visible, then this one does).
  if (pending_.has_value() && writing_ != submitted_) ++superseded_;
  pending_ = std::move(plan);
  ++submitted_;
  changed_.SignalAll();
}

void PlanPublisher::AddListener(Listener listener) {
  absl::MutexLock lock(&mu_);
  listeners_.push_back(std::move(listener));
}

PlanPublisher::PlanPtr PlanPublisher::Visible() const {
  absl::MutexLock lock(&mu_);
  return visible_;
}

PlanPublisher::PlanPtr PlanPublisher::WaitForNewer(uint64_t after_epoch,
                                                   absl::Duration timeout) const {
  // A condition variable, not a Mutex condition: a waiter wakes on a
  // publication only, and releasing mu_ does not re-check every waiter.
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (!stopping_ && (visible_ == nullptr || visible_->epoch() <= after_epoch)) {
    if (changed_.WaitWithDeadline(&mu_, deadline)) break;  // timed out
  }
  if (visible_ != nullptr && visible_->epoch() > after_epoch) return visible_;
  return nullptr;
}

void PlanPublisher::Flush() {
  absl::MutexLock lock(&mu_);
  const int64_t target = submitted_;
  while (done_ < target && !stopping_) changed_.Wait(&mu_);
}

void PlanPublisher::Shutdown() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  changed_.SignalAll();
}

int64_t PlanPublisher::published() const {
  absl::MutexLock lock(&mu_);
  return published_;
}

int64_t PlanPublisher::superseded() const {
  absl::MutexLock lock(&mu_);
  return superseded_;
}

int64_t PlanPublisher::write_failures() const {
  absl::MutexLock lock(&mu_);
  return write_failures_;
}

void PlanPublisher::Run() {
  absl::Duration backoff = options_.retry_initial;
  while (true) {
    v1::Plan plan;
    int64_t sequence;
    {
      absl::MutexLock lock(&mu_);
      while (!pending_.has_value() && !stopping_) changed_.Wait(&mu_);
      if (!pending_.has_value()) return;  // stopping, nothing left
      plan = *pending_;  // stays pending until written (or replaced)
      sequence = submitted_;
      writing_ = sequence;
    }
    if (options_.before_write) options_.before_write();
    const absl::Status written = options_.store->WritePlan(plan);
    if (!written.ok()) {
      GT_LOG(Warning) << "could not persist plan of epoch " << plan.epoch() << " ("
                      << options_.store->Describe() << "): " << written.message()
                      << "; the workers keep the plan they have, retrying";
      absl::MutexLock lock(&mu_);
      ++write_failures_;
      writing_ = 0;
      if (stopping_) return;
      // Until the backoff passes, or a newer plan replaces this one.
      const absl::Time deadline = absl::Now() + backoff;
      while (!stopping_ && submitted_ == sequence) {
        if (changed_.WaitWithDeadline(&mu_, deadline)) break;
      }
      backoff = std::min(backoff * 2, options_.retry_max);
      continue;
    }
    backoff = options_.retry_initial;
    PlanPtr made = std::make_shared<const v1::Plan>(std::move(plan));
    std::vector<Listener> listeners;
    {
      absl::MutexLock lock(&mu_);
      if (submitted_ == sequence) pending_.reset();
      writing_ = 0;
      visible_ = made;
      ++published_;
      listeners = listeners_;
      changed_.SignalAll();  // the watchers
    }
    for (const Listener& listener : listeners) listener(made);
    absl::MutexLock lock(&mu_);
    done_ = sequence;  // Flush returns once the listeners have run too
    changed_.SignalAll();
  }
}

}  // namespace geotrain
