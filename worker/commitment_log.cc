#include "worker/commitment_log.h"

#include <algorithm>
#include <utility>

#include "common/commitment.h"

namespace geotrain {
namespace {

LoggedMessage EntryOf(const LinkMessage& message, std::string peer, absl::Time at) {
  LoggedMessage entry;
  entry.kind = message.header.kind();
  entry.epoch = message.header.epoch();
  entry.microbatch = message.header.microbatch();
  entry.step = message.header.step();
  entry.weight_version = message.header.weight_version();
  entry.commitment = message.header.commitment();
  entry.payload_bytes = message.payload.size();
  entry.peer = std::move(peer);
  entry.at = at;
  return entry;
}

}  // namespace

CommitmentLog::CommitmentLog(CommitmentLogOptions options)
    : options_(options), max_payload_bytes_(options.max_payload_bytes) {}

void CommitmentLog::SetMaxPayloadBytes(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  max_payload_bytes_ = bytes;
  TrimPayloadsLocked();
}

void CommitmentLog::RecordReceived(const LinkMessage& message, std::string peer, absl::Time at) {
  if (!IsCommittedKind(message.header.kind())) return;
  absl::MutexLock lock(&mu_);
  AppendLocked(&received_, EntryOf(message, std::move(peer), at));
}

void CommitmentLog::RecordSent(const LinkMessage& message, absl::Time at) {
  if (!IsCommittedKind(message.header.kind())) return;
  LoggedMessage entry = EntryOf(message, "", at);
  uint64_t bound = 0;
  {
    absl::MutexLock lock(&mu_);
    bound = max_payload_bytes_;
  }
  const bool keep = message.payload.size() <= bound;
  if (keep) entry.message = std::make_shared<const LinkMessage>(message);  // outside the lock
  absl::MutexLock lock(&mu_);
  if (keep) kept_bytes_ += message.payload.size();
  AppendLocked(&sent_, std::move(entry));
  TrimPayloadsLocked();
}

void CommitmentLog::AppendLocked(Side* side, LoggedMessage entry) {
  const Key key{entry.kind, entry.epoch, entry.microbatch};
  side->newest[key] = side->first_index + side->entries.size();
  side->entries.push_back(std::move(entry));
  while (side->entries.size() > std::max<size_t>(1, options_.max_entries)) {
    const LoggedMessage& oldest = side->entries.front();
    const Key oldest_key{oldest.kind, oldest.epoch, oldest.microbatch};
    auto it = side->newest.find(oldest_key);
    if (it != side->newest.end() && it->second == side->first_index) side->newest.erase(it);
    if (oldest.message != nullptr) kept_bytes_ -= oldest.payload_bytes;
    side->entries.pop_front();
    ++side->first_index;
  }
}

void CommitmentLog::TrimPayloadsLocked() {
  first_kept_ = std::max(first_kept_, sent_.first_index);
  while (kept_bytes_ > max_payload_bytes_ &&
         first_kept_ < sent_.first_index + sent_.entries.size()) {
    LoggedMessage& entry = sent_.entries[first_kept_ - sent_.first_index];
    if (entry.message != nullptr) {
      kept_bytes_ -= entry.payload_bytes;
      entry.message.reset();
    }
    ++first_kept_;
  }
}

std::optional<LoggedMessage> CommitmentLog::Find(Direction direction, v1::MessageKind kind,
                                                 uint64_t epoch, uint64_t microbatch) const {
  absl::MutexLock lock(&mu_);
  const Side& side = direction == Direction::kReceived ? received_ : sent_;
  auto it = side.newest.find(Key{kind, epoch, microbatch});
  if (it == side.newest.end()) return std::nullopt;
  return side.entries[it->second - side.first_index];
}

std::optional<LoggedMessage> CommitmentLog::FindNewest(Direction direction, v1::MessageKind kind,
                                                       uint64_t microbatch) const {
  absl::MutexLock lock(&mu_);
  const Side& side = direction == Direction::kReceived ? received_ : sent_;
  for (auto it = side.entries.rbegin(); it != side.entries.rend(); ++it) {
    if (it->kind == kind && it->microbatch == microbatch) return *it;
  }
  return std::nullopt;
}

size_t CommitmentLog::entries(Direction direction) const {
  absl::MutexLock lock(&mu_);
  return (direction == Direction::kReceived ? received_ : sent_).entries.size();
}

uint64_t CommitmentLog::kept_payload_bytes() const {
  absl::MutexLock lock(&mu_);
  return kept_bytes_;
}

}  // namespace geotrain
