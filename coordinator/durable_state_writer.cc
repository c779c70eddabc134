#include "coordinator/durable_state_writer.h"

#include <utility>

#include "common/logging.h"

namespace geotrain {

DurableStateWriter::DurableStateWriter(WriteFn write, SnapshotFn snapshot)
    : write_(std::move(write)), snapshot_(std::move(snapshot)), thread_([this] { Run(); }) {}

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
  if (pending_.has_value() || dirty_) ++superseded_;
  dirty_ = false;
  pending_ = std::move(state);
  ++submitted_;
  changed_.SignalAll();
}

void DurableStateWriter::MarkDirty() {
  absl::MutexLock lock(&mu_);
  if (pending_.has_value() || dirty_) ++superseded_;
  pending_.reset();  // the snapshot will be newer
  dirty_ = true;
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
    bool snapshot;
    {
      absl::MutexLock lock(&mu_);
      while (!pending_.has_value() && !dirty_ && !stopping_) changed_.Wait(&mu_);
      if (!pending_.has_value() && !dirty_) return;  // stopping, nothing left
      snapshot = dirty_;
      if (!snapshot) state = std::move(*pending_);
      pending_.reset();
      dirty_ = false;
      sequence = submitted_;
    }
    // Taken after the mark: it holds every change marked before it.
    if (snapshot) state = snapshot_();
    absl::Status written = write_(state);
    if (!written.ok()) GT_LOG(Warning) << "could not persist state: " << written.message();
    absl::MutexLock lock(&mu_);
    ++writes_;
    done_ = sequence;
    changed_.SignalAll();
  }
}

}  // namespace geotrain
