#include "coordinator/durable_state_writer.h"

#include <utility>

#include "common/logging.h"

namespace geotrain {

DurableStateWriter::DurableStateWriter(WriteFn write)
    : write_(std::move(write)), thread_([this] { Run(); }) {}

DurableStateWriter::~DurableStateWriter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
  }
  thread_.join();
}

void DurableStateWriter::Submit(v1::CoordinatorState state) {
  absl::MutexLock lock(&mu_);
  if (pending_.has_value()) ++superseded_;
  pending_ = std::move(state);
  ++submitted_;
  changed_.SignalAll();
}

void DurableStateWriter::Flush() {
  absl::MutexLock lock(&mu_);
  const int64_t target = submitted_;
  while (done_ < target) changed_.Wait(&mu_);
}

int64_t DurableStateWriter::writes() const {
  absl::MutexLock lock(&mu_);
  return writes_;
}

int64_t DurableStateWriter::superseded() const {
  absl::MutexLock lock(&mu_);
  return superseded_;
}

void DurableStateWriter::Run() {
  while (true) {
    v1::CoordinatorState state;
    int64_t sequence;
    {
      absl::MutexLock lock(&mu_);
      while (!pending_.has_value() && !stopping_) changed_.Wait(&mu_);
      if (!pending_.has_value()) return;  // stopping, nothing left
      state = std::move(*pending_);
      pending_.reset();
      sequence = submitted_;
    }
    absl::Status written = write_(state);
    if (!written.ok()) GT_LOG(Warning) << "could not persist state: " << written.message();
    absl::MutexLock lock(&mu_);
    ++writes_;
    done_ = sequence;
    changed_.SignalAll();
  }
}

}  // namespace geotrain
