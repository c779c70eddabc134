#include "coordinator/membership.h"

#include <algorithm>
#include <cmath>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "common/rpc_options.h"

namespace geotrain {
namespace {

constexpr size_t kMaxNameBytes = 128;
constexpr size_t kMaxAddressBytes = 256;
constexpr size_t kMaxDeviceStringBytes = 512;
constexpr size_t kMaxStatsEntries = 64;
constexpr size_t kMaxStatsStringBytes = 256;
// LinkStats.received_rms_by_step: entries kept per link (the worker sends
// 16), and the most bytes one takes on the wire.
constexpr size_t kMaxStepSamples = 16;
constexpr size_t kMaxStepSampleBytes = 24;
constexpr double kMaxGflops = 1e7;          // 10 PFLOP/s: no single device is faster
constexpr uint64_t kMaxMemoryBytes = 1ULL << 50;  // 1 PiB

bool Printable(const std::string& s) {
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) return false;
  }
  return true;
}

double Finite(double x) { return std::isfinite(x) ? x : 0; }

std::string Cut(const std::string& s) { return s.substr(0, kMaxStatsStringBytes); }

// "w12" -> 12, else -1.
int WorkerNumber(const std::string& id) {
  int n = -1;
  if (id.size() < 2 || id[0] != 'w' || !absl::SimpleAtoi(id.substr(1), &n)) return -1;
  return n;
}

// The first double or float field of `message` (at any depth, in map
// values and repeated fields too) that is NaN or infinite, by its path;
// empty when there is none.
std::string FirstNonFinite(const google::protobuf::Message& message, const std::string& prefix) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* reflection = message.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const FieldDescriptor* field : fields) {
    const std::string path = prefix.empty() ? field->name() : prefix + "." + field->name();
    const int n = field->is_repeated() ? reflection->FieldSize(message, field) : 1;
    for (int i = 0; i < n; ++i) {
      const bool repeated = field->is_repeated();
      switch (field->cpp_type()) {
        case FieldDescriptor::CPPTYPE_DOUBLE: {
          const double v = repeated ? reflection->GetRepeatedDouble(message, field, i)
                                    : reflection->GetDouble(message, field);
          if (!std::isfinite(v)) return path;
          break;
        }
        case FieldDescriptor::CPPTYPE_FLOAT: {
          const float v = repeated ? reflection->GetRepeatedFloat(message, field, i)
                                   : reflection->GetFloat(message, field);
          if (!std::isfinite(v)) return path;
          break;
        }
        case FieldDescriptor::CPPTYPE_MESSAGE: {
          const google::protobuf::Message& inner =
              repeated ? reflection->GetRepeatedMessage(message, field, i)
                       : reflection->GetMessage(message, field);
          std::string found = FirstNonFinite(inner, path);
          if (!found.empty()) return found;
          break;
        }
        default:
          break;
      }
    }
  }
  return "";
}

}  // namespace

absl::Status CheckAllFinite(const google::protobuf::Message& message) {
  const std::string field = FirstNonFinite(message, "");
  if (field.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(message.GetDescriptor()->name(), " field ",
                                                 field, " is not a finite number"));
}

absl::Status ValidateHeartbeatRequest(const v1::HeartbeatRequest& request) {
  return CheckAllFinite(request);
}

absl::Status ValidateWorkerName(const std::string& name) {
  if (name.size() > kMaxNameBytes || !Printable(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker name of ", name.size(), " bytes: at most ", kMaxNameBytes,
        " printable bytes"));
  }
  return absl::OkStatus();
}

absl::Status ValidateJoinRequest(const v1::JoinRequest& request) {
  if (absl::Status name = ValidateWorkerName(request.name()); !name.ok()) return name;
  if (absl::Status address = CheckHostPort(request.address()); !address.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("join ", address.message(), ": peers must be able to dial it"));
  }
  if (absl::Status finite = CheckAllFinite(request); !finite.ok()) return finite;
  if (request.session_id().size() > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "join with a session_id of ", request.session_id().size(), " bytes: at most 64"));
  }
  if (request.role() == v1::MEMBER_ROLE_RELAY) {
    if (request.has_device()) return absl::InvalidArgumentError("a relay joins without a device");
    return absl::OkStatus();
  }
  if (request.role() != v1::MEMBER_ROLE_UNSPECIFIED && request.role() != v1::MEMBER_ROLE_WORKER) {
    return absl::InvalidArgumentError(absl::StrCat("join with unknown role ", request.role()));
  }
  const v1::DeviceInfo& d = request.device();
  if (!std::isfinite(d.matmul_gflops()) || d.matmul_gflops() <= 0 ||
      d.matmul_gflops() > kMaxGflops) {
    return absl::InvalidArgumentError(absl::StrCat(
        "join with ", d.matmul_gflops(), " GFLOP/s: must be finite, positive and at most 1e7"));
  }
  if (d.memory_bytes() > kMaxMemoryBytes || d.memory_total_bytes() > kMaxMemoryBytes) {
    return absl::InvalidArgumentError("join with more than 1 PiB of memory");
  }
  if (d.threads() < 0 || d.threads() > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("join with ", d.threads(), " threads"));
  }
  for (const std::string* field : {&d.device(), &d.blas(), &d.threads_reason(),
                                   &d.environment()}) {
    if (field->size() > kMaxDeviceStringBytes) {
      return absl::InvalidArgumentError("join with a device description over 512 bytes");
    }
  }
  return absl::OkStatus();
}

v1::StageStats BoundedStageStats(const v1::StageStats& stats) {
  v1::StageStats out = stats;
  out.set_schedule(Cut(out.schedule()));
  out.set_threads_reason(Cut(out.threads_reason()));
  out.set_waiting_on(out.waiting_on().substr(0, kMaxNameBytes));
  out.set_waiting_s(std::max(0.0, Finite(out.waiting_s())));
  out.set_staleness_mean(Finite(out.staleness_mean()));
  out.set_bubble_fraction(Finite(out.bubble_fraction()));
  out.set_microbatches_per_s(Finite(out.microbatches_per_s()));
  out.set_compute_s_per_microbatch(Finite(out.compute_s_per_microbatch()));
  if (out.links_size() > static_cast<int>(kMaxStatsEntries)) {
    out.mutable_links()->DeleteSubrange(kMaxStatsEntries, out.links_size() - kMaxStatsEntries);
  }
  if (out.routes_size() > static_cast<int>(kMaxStatsEntries)) {
    out.mutable_routes()->DeleteSubrange(kMaxStatsEntries, out.routes_size() - kMaxStatsEntries);
  }
  for (v1::LinkStats& link : *out.mutable_links()) {
    // The newest sampled steps, as many as a worker reports; each is a few
    // numbers.
    auto* samples = link.mutable_received_rms_by_step();
    if (samples->size() > static_cast<int>(kMaxStepSamples)) {
      samples->DeleteSubrange(0, samples->size() - kMaxStepSamples);
    }
    std::string bytes;
    link.SerializeToString(&bytes);
    if (bytes.size() > 4 * kMaxStatsStringBytes + kMaxStepSamples * kMaxStepSampleBytes) {
      link.Clear();
    }
  }
  for (v1::RouteStats& route : *out.mutable_routes()) {
    std::string bytes;
    route.SerializeToString(&bytes);
    if (bytes.size() > 4 * kMaxStatsStringBytes) route.Clear();
  }
  return out;
}

Membership::Membership(const Clock* clock, int64_t lease_ms)
    : clock_(clock), lease_ms_(lease_ms) {}

WorkerRecord* Membership::FindLocked(const std::string& id) {
  auto it = index_.find(id);
  return it == index_.end() ? nullptr : &workers_[it->second];
}

const WorkerRecord* Membership::FindLocked(const std::string& id) const {
  auto it = index_.find(id);
  return it == index_.end() ? nullptr : &workers_[it->second];
}

void Membership::ReindexLocked() {
  index_.clear();
  for (size_t i = 0; i < workers_.size(); ++i) index_[workers_[i].id] = i;
}

WorkerRecord Membership::Join(const std::string& name, const std::string& address,
                              const v1::DeviceInfo& device, const std::string& id,
                              v1::MemberRole role, const v1::Reachability& reachability,
                              const std::string& session, bool* retried) {
  absl::MutexLock lock(&mu_);
  if (retried != nullptr) *retried = false;
  const int64_t now = clock_->NowMs();
  WorkerRecord* record = id.empty() ? nullptr : FindLocked(id);
  if (!session.empty()) {
    // A retry: the same process (session), its member still live. Without
    // an id (insecure), the session is looked up among the live members.
    WorkerRecord* same = record;
    if (same == nullptr && id.empty()) {
      for (auto it = workers_.rbegin(); it != workers_.rend() && same == nullptr; ++it) {
        if (it->session == session && it->alive) same = &*it;
      }
    }
    if (same != nullptr && same->session == session && same->alive &&
        now - same->last_heartbeat_ms <= lease_ms_) {
      same->last_heartbeat_ms = now;
      ++answered_joins_[same->id];
      if (retried != nullptr) *retried = true;
      return *same;
    }
  }
  const bool added = record == nullptr;
  if (record == nullptr) {
    record = &workers_.emplace_back();
    record->join_order = next_join_order_++;
    record->id = id.empty() ? absl::StrCat("w", next_number_) : id;
    next_number_ = std::max(next_number_, WorkerNumber(record->id) + 1);
    index_[record->id] = workers_.size() - 1;
  }
  // A worker that joins again (with its certificate) keeps its id.
  record->name = name.empty() ? record->id : name;
  record->address = address;
  record->device = device;
  record->role = role == v1::MEMBER_ROLE_UNSPECIFIED ? v1::MEMBER_ROLE_WORKER : role;
  record->reachability = reachability;
  record->joined_ms = now;
  record->last_heartbeat_ms = record->joined_ms;
  record->alive = true;
  record->end_reason.clear();
  record->stats.Clear();
  record->session = session;
  answered_joins_[record->id] = 1;
  ++persisted_version_;
  if (added && !live_cache_stale_ && live_cache_ != nullptr) {
    AddLivePeerLocked(*record);
  } else {
    live_cache_stale_ = true;
  }
  return *record;
}

void Membership::AddLivePeerLocked(const WorkerRecord& w) {
  if (w.relay()) return;
  // Copy on write: a heartbeat may still be reading the list it was given.
  if (live_cache_.use_count() > 1) live_cache_ = std::make_shared<std::vector<WorkerRecord>>(*live_cache_);
  live_cache_->push_back(LivePeerOf(w));
}

bool Membership::Abandon(const std::string& id, const std::string& session) {
  absl::MutexLock lock(&mu_);
  WorkerRecord* record = FindLocked(id);
  if (record == nullptr || record->session != session || !record->alive) return false;
  if (--answered_joins_[id] > 0) return false;  // another attempt was answered with it
  answered_joins_.erase(id);
  live_cache_stale_ = true;
  ++persisted_version_;
  workers_.erase(workers_.begin() + index_[id]);
  ReindexLocked();
  return true;
}

bool Membership::Knows(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return FindLocked(id) != nullptr;
}

std::optional<WorkerRecord> Membership::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  const WorkerRecord* record = FindLocked(id);
  if (record == nullptr) return std::nullopt;
  return *record;
}

std::string Membership::NameOf(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  const WorkerRecord* record = FindLocked(id);
  return record == nullptr ? id : record->name;
}

bool Membership::IsLive(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  const WorkerRecord* w = FindLocked(id);
  return w != nullptr && w->alive && clock_->NowMs() - w->last_heartbeat_ms <= lease_ms_;
}

void Membership::PruneDead(size_t keep_dead) {
  absl::MutexLock lock(&mu_);
  size_t dead = 0;
  for (const WorkerRecord& w : workers_) dead += w.alive ? 0 : 1;
  if (dead <= keep_dead) return;
  // The live peers are unchanged: only the dead go.
  ++persisted_version_;
  for (auto it = workers_.begin(); it != workers_.end() && dead > keep_dead;) {
    if (it->alive) {
      ++it;
    } else {
      answered_joins_.erase(it->id);
      it = workers_.erase(it);
      --dead;
    }
  }
  ReindexLocked();
}

bool Membership::Heartbeat(const std::string& id, uint64_t rss_bytes, int step,
                           const v1::StageStats& stats) {
  v1::StageStats bounded = BoundedStageStats(stats);  // off the lock
  absl::MutexLock lock(&mu_);
  WorkerRecord* w = FindLocked(id);
  if (w == nullptr) return false;
  // A lease that ran out stays out, even before ExpireLeases notices:
  // the worker must join again (and is planned anew).
  if (!w->alive || clock_->NowMs() - w->last_heartbeat_ms > lease_ms_) return false;
  w->last_heartbeat_ms = clock_->NowMs();
  w->rss_bytes = rss_bytes;
  w->step = step;
  w->stats = std::move(bounded);
  return true;
}

void Membership::SetLayerTimings(
    const std::string& id, const google::protobuf::Map<std::string, double>& seconds_per_sample) {
  std::map<std::string, double> kept;
  for (const auto& [kind, seconds] : seconds_per_sample) {
    if (kept.size() >= 16 || kind.empty() || kind.size() > 32) continue;
    if (!std::isfinite(seconds) || seconds < 1e-9 || seconds > 1000) continue;
    kept[kind] = seconds;
  }
  absl::MutexLock lock(&mu_);
  WorkerRecord* w = FindLocked(id);
  // Workers repeat their timings in every heartbeat: only a change counts.
  if (w == nullptr || w->layer_seconds_per_sample == kept) return;
  w->layer_seconds_per_sample = std::move(kept);
}

void Membership::SetReachability(const std::string& id, const v1::Reachability& reachability) {
  absl::MutexLock lock(&mu_);
  ++persisted_version_;
  if (WorkerRecord* w = FindLocked(id)) w->reachability = reachability;
}

bool Membership::Leave(const std::string& id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  live_cache_stale_ = true;
  ++persisted_version_;
  WorkerRecord* w = FindLocked(id);
  if (w == nullptr || !w->alive) return false;
  w->alive = false;
  w->end_reason = reason;
  return true;
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
  if (!expired.empty()) {
    live_cache_stale_ = true;
    ++persisted_version_;
  }
  return expired;
}

void Membership::Restore(std::vector<WorkerRecord> records, int next_number) {
  absl::MutexLock lock(&mu_);
  live_cache_stale_ = true;
  ++persisted_version_;
  next_number_ = std::max(next_number_, next_number);
  const int64_t now = clock_->NowMs();
  for (WorkerRecord& record : records) {
    record.joined_ms = now;
    record.last_heartbeat_ms = now;
    next_number_ = std::max(next_number_, WorkerNumber(record.id) + 1);
    next_join_order_ = std::max(next_join_order_, record.join_order + 1);
  }
  workers_ = std::move(records);
  ReindexLocked();
}

uint64_t Membership::persisted_version() const {
  absl::MutexLock lock(&mu_);
  return persisted_version_;
}

int Membership::next_number() const {
  absl::MutexLock lock(&mu_);
  return next_number_;
}

std::vector<WorkerRecord> Membership::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return workers_;
}

std::vector<WorkerRecord> Membership::LiveWorkers() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerRecord> live;
  for (const WorkerRecord& w : workers_) {
    if (w.alive && !w.relay()) live.push_back(w);
  }
  return live;
}

WorkerRecord Membership::LivePeerOf(const WorkerRecord& w) {
  WorkerRecord peer;
  peer.id = w.id;
  peer.name = w.name;
  peer.address = w.address;
  peer.role = w.role;
  peer.join_order = w.join_order;
  return peer;
}

std::shared_ptr<const std::vector<WorkerRecord>> Membership::SharedLivePeers(
    uint64_t* generation) const {
  absl::MutexLock lock(&mu_);
  if (live_cache_ == nullptr || live_cache_stale_) {
    live_cache_stale_ = false;
    ++live_generation_;
    auto live = std::make_shared<std::vector<WorkerRecord>>();
    live->reserve(workers_.size());
    for (const WorkerRecord& w : workers_) {
      if (w.alive && !w.relay()) live->push_back(LivePeerOf(w));
    }
    live_cache_ = std::move(live);
  }
  if (generation != nullptr) *generation = live_generation_;
  return live_cache_;
}

std::vector<WorkerRecord> Membership::ProbeCandidates(const std::string& exclude,
                                                      size_t n) const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerRecord> picked;
  for (const bool reachable : {true, false}) {
    for (const WorkerRecord& w : workers_) {
      if (picked.size() == n) return picked;
      if (!w.alive || w.relay() || w.id == exclude) continue;
      if ((!w.reachability.known() || w.reachability.reachable()) != reachable) continue;
      picked.push_back(w);
    }
  }
  return picked;
}

std::vector<std::pair<std::string, int64_t>> Membership::LiveRss(size_t most) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, int64_t>> rss;
  for (const WorkerRecord& w : workers_) {
    if (rss.size() >= most) break;
    if (w.alive) rss.emplace_back(w.name, static_cast<int64_t>(w.rss_bytes));
  }
  return rss;
}

std::vector<WorkerRecord> Membership::LiveRelays() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerRecord> live;
  for (const WorkerRecord& w : workers_) {
    if (w.alive && w.relay()) live.push_back(w);
  }
  return live;
}

}  // namespace geotrain
