// The evidence of what went over this worker's pipeline links: every
// training message it received, with the sender's commitment
// (common/commitment.h) and authenticated id, and every one it sent, with
// the bytes themselves while a byte bound allows. A spot check
// (docs/verification.md) looks up a microbatch here: the receiver's entry
// holds the sender to what it sent, and the sender's kept bytes are the
// input a verifier recomputes from, checked against that commitment.
//
// Bounded: at most `max_entries` of each direction (the oldest go first),
// and at most `max_payload_bytes` of kept bytes (the oldest entries lose
// their bytes first, keeping their commitment). Thread-safe.
#ifndef GEOTRAIN_WORKER_COMMITMENT_LOG_H_
#define GEOTRAIN_WORKER_COMMITMENT_LOG_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/link_message.h"

namespace geotrain {

struct CommitmentLogOptions {
  size_t max_entries = 16384;  // per direction (a few MiB of commitments)
  // Sent messages' bytes kept: a spot check's inputs. None by default
  // until audits run during a job and size it from their window: the
  // copies are resident memory and allocator churn on every worker, and
  // nothing reads them yet.
  uint64_t max_payload_bytes = 0;
};

struct LoggedMessage {
  v1::MessageKind kind = v1::MESSAGE_KIND_UNSPECIFIED;
  uint64_t epoch = 0;
  uint64_t microbatch = 0;
  int step = 0;
  int64_t weight_version = 0;
  std::string commitment;
  uint64_t payload_bytes = 0;
  // Received: the sender's worker id (its link's authenticated peer).
  // Sent: empty (the link, or a replica router, picks the receiver).
  std::string peer;
  absl::Time at;
  // Sent messages, while the byte bound keeps them: the whole message.
  std::shared_ptr<const LinkMessage> message;
};

class CommitmentLog {
 public:
  explicit CommitmentLog(CommitmentLogOptions options = {});

  enum class Direction { kReceived, kSent };

  // Logs a committed message (IsCommittedKind); others are ignored. A
  // received message must have passed its commitment check (LinkValidator).
  void RecordReceived(const LinkMessage& message, std::string peer, absl::Time at);
  // A sent message: its commitment, and a copy of it when it fits the byte
  // bound (only then is it copied).
  void RecordSent(const LinkMessage& message, absl::Time at);

  // The newest entry of `direction` for (kind, epoch, microbatch), if still
  // logged.
  std::optional<LoggedMessage> Find(Direction direction, v1::MessageKind kind, uint64_t epoch,
                                    uint64_t microbatch) const;
  // The newest entry of `direction` for (kind, microbatch) in any epoch (a
  // spot check names the microbatch of a committed step; a pipeline that
  // goes on through a re-plan keeps its links' epoch). O(entries).
  std::optional<LoggedMessage> FindNewest(Direction direction, v1::MessageKind kind,
                                          uint64_t microbatch) const;

  // The byte bound from now on (spot checks: the job turns them on after
  // the log is made). A smaller bound drops the oldest bytes at once.
  void SetMaxPayloadBytes(uint64_t bytes);

  size_t entries(Direction direction) const;
  uint64_t kept_payload_bytes() const;

 private:
  using Key = std::tuple<int, uint64_t, uint64_t>;  // kind, epoch, microbatch
  struct Side {
    std::deque<LoggedMessage> entries;  // oldest first
    uint64_t first_index = 0;           // of entries.front(), counted from the start
    std::map<Key, uint64_t> newest;     // index of the newest entry per key
  };
  void AppendLocked(Side* side, LoggedMessage entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TrimPayloadsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CommitmentLogOptions options_;
  mutable absl::Mutex mu_;
  uint64_t max_payload_bytes_ ABSL_GUARDED_BY(mu_);
  Side received_ ABSL_GUARDED_BY(mu_);
  Side sent_ ABSL_GUARDED_BY(mu_);
  uint64_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Sent entries at or after this index may still hold their bytes.
  uint64_t first_kept_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_COMMITMENT_LOG_H_
