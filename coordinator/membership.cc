#include "coordinator/membership.h"

#include "absl/strings/str_cat.h"

namespace geotrain {

Membership::Membership(const Clock* clock, int64_t lease_ms)
    : clock_(clock), lease_ms_(lease_ms) {}

WorkerRecord Membership::Join(const std::string& name,
                              const std::string& address,
                              const v1::DeviceInfo& device) {
  absl::MutexLock lock(&mu_);
  WorkerRecord record;
  record.join_order = static_cast<int>(workers_.size());
  record.id = absl::StrCat("w", record.join_order);
  record.name = name.empty() ? record.id : name;
  record.address = address;
  record.device = device;
  record.joined_ms = clock_->NowMs();
  record.last_heartbeat_ms = record.joined_ms;
  workers_.push_back(record);
  return record;
}

bool Membership::Heartbeat(const std::string& id, uint64_t rss_bytes, int step,
                           const v1::StageStats& stats) {
  absl::MutexLock lock(&mu_);
  for (WorkerRecord& w : workers_) {
    if (w.id != id) continue;
    if (!w.alive) return false;
    w.last_heartbeat_ms = clock_->NowMs();
    w.rss_bytes = rss_bytes;
    w.step = step;
    w.stats = stats;
    return true;
  }
  return false;
}

bool Membership::Leave(const std::string& id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  for (WorkerRecord& w : workers_) {
    if (w.id == id && w.alive) {
      w.alive = false;
      w.end_reason = reason;
      return true;
    }
  }
  return false;
}

std::vector<WorkerRecord> Membership::ExpireLeases() {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerRecord> expired;
  const int64_t now = clock_->NowMs();
  for (WorkerRecord& w : workers_) {
    if (w.alive && now - w.last_heartbeat_ms > lease_ms_) {
      w.alive = false;
      w.end_reason = absl::StrCat("no heartbeat for ", now - w.last_heartbeat_ms,
                                  " ms (lease ", lease_ms_, " ms)");
      expired.push_back(w);
    }
  }
  return expired;
}

void Membership::Restore(std::vector<WorkerRecord> records) {
  absl::MutexLock lock(&mu_);
  const int64_t now = clock_->NowMs();
  for (WorkerRecord& record : records) {
    record.joined_ms = now;
    record.last_heartbeat_ms = now;
  }
  workers_ = std::move(records);
}

std::vector<WorkerRecord> Membership::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return workers_;
}

std::vector<WorkerRecord> Membership::LiveWorkers() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerRecord> live;
  for (const WorkerRecord& w : workers_) {
    if (w.alive) live.push_back(w);
  }
  return live;
}

}  // namespace geotrain
