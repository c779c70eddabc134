// Writes the coordinator's state to disk on a thread of its own, so that no
// caller (a step report above all) waits on an fsync. Latest wins: a state
// submitted while an older one is being written replaces any not yet
// started, so a slow disk costs staleness of the file, never a queue.
//
// With a snapshot function, callers need not build the state at all
// (MarkDirty costs O(1) however many members the state lists): the
// writer's thread takes the snapshot when its turn comes, so a burst of
// changes (a thousand joins, a hundred steps a second) costs one snapshot
// per write. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_DURABLE_STATE_WRITER_H_
#define GEOTRAIN_COORDINATOR_DURABLE_STATE_WRITER_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class DurableStateWriter {
 public:
  using WriteFn = std::function<absl::Status(const v1::CoordinatorState&)>;
  using SnapshotFn = std::function<v1::CoordinatorState()>;

  // `write` runs on the writer's thread only (one call at a time); a failed
  // write is logged and the next submitted state is written as usual.
  // `snapshot` (for MarkDirty) runs there too; it must stay callable until
  // the writer is destroyed.
  explicit DurableStateWriter(WriteFn write, SnapshotFn snapshot = nullptr);
  // Writes what is pending, then stops.
  ~DurableStateWriter();
  DurableStateWriter(const DurableStateWriter&) = delete;
  DurableStateWriter& operator=(const DurableStateWriter&) = delete;

  // Never blocks on the disk: takes the state and returns.
  void Submit(v1::CoordinatorState state);
  // The state changed: a snapshot of it is written (REQUIRES: a snapshot
  // function). O(1); marks and submits before the write coalesce.
  void MarkDirty();
  // Waits until every state submitted before the call is written (or
  // failed). For shutdown and tests.
  void Flush();
  // States written so far (successfully or not), and submits superseded
  // before their turn.
  int64_t writes() const;
  int64_t superseded() const;

 private:
  void Run();

  const WriteFn write_;
  const SnapshotFn snapshot_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // a submit, a write done, or stopping
  std::optional<v1::CoordinatorState> pending_ ABSL_GUARDED_BY(mu_);
  bool dirty_ ABSL_GUARDED_BY(mu_) = false;  // a snapshot is to be written
  int64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;  // sequence of the newest submit
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;       // sequence of the newest written
  int64_t writes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t superseded_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_DURABLE_STATE_WRITER_H_
