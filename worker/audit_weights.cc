#include "worker/audit_weights.h"

#include <utility>

namespace geotrain {

void AuditWeights::SetMaxBytes(uint64_t max_bytes) {
  absl::MutexLock lock(&mu_);
  max_bytes_ = max_bytes;
  TrimLocked();
}

bool AuditWeights::enabled() const {
  absl::MutexLock lock(&mu_);
  return max_bytes_ > 0;
}

void AuditWeights::Keep(KeptWeights weights) {
  absl::MutexLock lock(&mu_);
  if (max_bytes_ == 0 || weights.bytes > max_bytes_) return;
  if (!kept_.empty() && kept_.back().layer_begin != weights.layer_begin) {
    kept_.clear();
    bytes_ = 0;
  }
  bytes_ += weights.bytes;
  kept_.push_back(std::move(weights));
  TrimLocked();
}

void AuditWeights::TrimLocked() {
  while (!kept_.empty() && bytes_ > max_bytes_) {
    bytes_ -= kept_.front().bytes;
    kept_.pop_front();
  }
}

std::optional<KeptWeights> AuditWeights::Find(int64_t version, const std::string& digest) const {
  absl::MutexLock lock(&mu_);
  for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
    if (it->version == version && (digest.empty() || it->digest == digest)) return *it;
  }
  return std::nullopt;
}

std::optional<int64_t> AuditWeights::newest(int layer_begin) const {
  absl::MutexLock lock(&mu_);
  if (kept_.empty() || kept_.back().layer_begin != layer_begin) return std::nullopt;
  return kept_.back().version;
}

uint64_t AuditWeights::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

size_t AuditWeights::versions() const {
  absl::MutexLock lock(&mu_);
  return kept_.size();
}

}  // namespace geotrain
