#include "coordinator/network_matrix.h"

#include <algorithm>
#include <cmath>
#include <functional>

namespace geotrain {
namespace {

// Figures a worker reports are bounded before they are kept: a forged or
// broken one must not make a pair look absurdly good.
constexpr double kMaxRateBps = 1e12;  // 1 Tb/s
constexpr double kMaxRttS = 60;
// A worker whose sample is all fresh is looked at again this much later.
constexpr int64_t kRecheckMs = 30 * 1000;

bool Plausible(double rtt_s, double rate_bps) {
  return std::isfinite(rtt_s) && std::isfinite(rate_bps) && rtt_s >= 0 && rtt_s <= kMaxRttS &&
         rate_bps >= 0 && rate_bps <= kMaxRateBps;
}

// The rank of `peer` in `worker`'s sample order (lower first): the two
// ids' hashes mixed (splitmix64's finalizer), without building a string.
uint64_t PairRank(size_t worker_hash, const std::string& peer) {
  uint64_t h = static_cast<uint64_t>(worker_hash) * 0x9e3779b97f4a7c15ull ^
               static_cast<uint64_t>(std::hash<std::string>()(peer));
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h;
}

}  // namespace

std::vector<const WorkerRecord*> NetworkMatrix::SampleFor(
    const std::string& worker, const std::vector<WorkerRecord>& live,
    uint64_t live_generation) const {
  const size_t k = static_cast<size_t>(std::max(0, options_.sample));
  // Where the list only grew since this worker's sample was ranked, only
  // the newcomers are ranked: a heartbeat's task costs O(newcomers), and
  // O(members) once per change of the live set, not once per task.
  Sample sample;
  if (live_generation != 0) {
    absl::MutexLock lock(&mu_);
    auto cached = samples_.find(worker);
    if (cached != samples_.end() && cached->second.generation == live_generation &&
        cached->second.ranked_upto <= live.size()) {
      sample = cached->second;
    }
  }
  if (sample.generation != live_generation || live_generation == 0) {
    sample = Sample{live_generation, 0, {}};
  }
  const size_t worker_hash = std::hash<std::string>()(worker);
  auto before = [&](const std::pair<uint64_t, size_t>& a, const std::pair<uint64_t, size_t>& b) {
    return a.first != b.first ? a.first < b.first : live[a.second].id < live[b.second].id;
  };
  for (size_t i = sample.ranked_upto; i < live.size() && k > 0; ++i) {
    const WorkerRecord& w = live[i];
    if (w.id == worker || w.relay() || !w.alive) continue;
    const std::pair<uint64_t, size_t> entry{PairRank(worker_hash, w.id), i};
    if (sample.best.size() == k && !before(entry, sample.best.back())) continue;
    sample.best.insert(
        std::upper_bound(sample.best.begin(), sample.best.end(), entry, before), entry);
    if (sample.best.size() > k) sample.best.pop_back();
  }
  sample.ranked_upto = live.size();
  std::vector<const WorkerRecord*> peers;
  peers.reserve(sample.best.size());
  for (const auto& [rank, index] : sample.best) peers.push_back(&live[index]);
  // A newcomer enters this sample only below the last one's rank (Learn).
  absl::MutexLock lock(&mu_);
  if (k > 0 && sample.best.size() == k) {
    sample_bound_[worker] = sample.best.back().first;
  } else {
    sample_bound_.erase(worker);
  }
  if (live_generation != 0) samples_[worker] = std::move(sample);
  return peers;
}

std::optional<v1::ProbeTask> NetworkMatrix::NextTask(const std::string& worker,
                                                     const std::vector<WorkerRecord>& live,
                                                     int64_t now_ms, uint64_t live_generation) {
  const std::vector<const WorkerRecord*> sample = SampleFor(worker, live, live_generation);
  absl::MutexLock lock(&mu_);
  if (auto pending = pending_.find(worker); pending != pending_.end()) {
    if (now_ms - pending->second.second < options_.task_timeout_ms) return std::nullopt;
    pending_.erase(pending);
  }
  const WorkerRecord* oldest = nullptr;
  int64_t oldest_ms = 0;
  for (const WorkerRecord* peer : sample) {
    // Probed (answered or failed) is what counts: a failed probe is not
    // asked again before the refresh, so one unreachable peer cannot keep
    // the others from being measured.
    auto entry = entries_.find({worker, peer->id});
    const bool probed = entry != entries_.end() && entry->second.probed_ms > 0;
    const int64_t at = probed ? entry->second.probed_ms : -1;
    if (probed && now_ms - at < options_.refresh_ms) continue;
    if (oldest == nullptr || at < oldest_ms) {
      oldest = peer;
      oldest_ms = at;
    }
  }
  if (oldest == nullptr) {
    next_check_ms_[worker] = now_ms + kRecheckMs;
    return std::nullopt;
  }
  // Measures are small and one at a time per prober: only an access task
  // keeps one waiting.
  if (PortsBusyLocked({worker, oldest->id}, worker, now_ms, /*measures_too=*/false)) {
    return std::nullopt;
  }
  v1::ProbeTask task;
  task.set_worker_id(oldest->id);
  task.set_address(oldest->address);
  task.set_measure_bytes(options_.probe_bytes);
  pending_[worker] = {oldest->id, now_ms};
  return task;
}

bool NetworkMatrix::PortsBusyLocked(const std::vector<std::string>& members,
                                    const std::string& except, int64_t now_ms,
                                    bool measures_too) const {
  auto member = [&](const std::string& id) {
    return std::find(members.begin(), members.end(), id) != members.end();
  };
  for (const auto& [owner, access] : access_pending_) {
    if (owner == except || now_ms - access.sent_ms >= options_.task_timeout_ms) continue;
    for (const std::string& id : access.members) {
      if (member(id)) return true;
    }
  }
  if (!measures_too) return false;
  for (const auto& [prober, target] : pending_) {
    if (prober == except || now_ms - target.second >= options_.task_timeout_ms) continue;
    if (member(prober) || member(target.first)) return true;
  }
  return false;
}

bool NetworkMatrix::SampleMeasured(const std::string& worker,
                                   const std::vector<WorkerRecord>& live) const {
  const std::vector<const WorkerRecord*> sample = SampleFor(worker, live);
  absl::MutexLock lock(&mu_);
  for (const WorkerRecord* peer : sample) {
    auto entry = entries_.find({worker, peer->id});
    if (entry == entries_.end() || entry->second.probed_ms == 0) return false;
  }
  return true;
}

void NetworkMatrix::RecordProbe(const std::string& prober, const v1::ProbeResult& result,
                                int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  auto pending = pending_.find(prober);
  if (pending == pending_.end() || pending->second.first != result.worker_id()) return;
  pending_.erase(pending);
  Entry& entry = entries_[{prober, result.worker_id()}];
  incoming_.insert({result.worker_id(), prober});
  entry.updated_ms = now_ms;
  entry.probed_ms = std::max<int64_t>(now_ms, 1);
  if (!result.reachable() || !Plausible(result.rtt_s(), result.rate_bps()) ||
      result.rtt_s() <= 0) {
    // Not reachable from this side: the link will be dialled the other way
    // (or relayed); a failed probe is remembered so it is not retried before
    // the refresh, and it clears what an older probe said.
    entry.rtt_s = 0;
    entry.rate_bps = 0;
    entry.source = "probe";
    return;
  }
  entry.rtt_s = result.rtt_s();
  entry.rate_bps = result.rate_bps();
  entry.source = "probe";
}

bool NetworkMatrix::WantsTask(const std::string& worker, int64_t now_ms) const {
  absl::MutexLock lock(&mu_);
  if (auto pending = pending_.find(worker);
      pending != pending_.end() && now_ms - pending->second.second < options_.task_timeout_ms) {
    return false;
  }
  auto next = next_check_ms_.find(worker);
  return next == next_check_ms_.end() || next->second <= now_ms;
}

void NetworkMatrix::Learn(const std::string& worker, const std::string& address) {
  absl::MutexLock lock(&mu_);
  worker_at_[address] = worker;
  addresses_of_[worker].insert(address);
  // A new peer: the workers whose sample it enters have it to measure
  // (those with a sample not yet full, and those it ranks into); the others
  // are not asked again, so a join costs a hash per member, not a sample.
  for (auto it = next_check_ms_.begin(); it != next_check_ms_.end();) {
    auto bound = sample_bound_.find(it->first);
    if (it->first == worker || bound == sample_bound_.end() ||
        PairRank(std::hash<std::string>()(it->first), worker) < bound->second) {
      it = next_check_ms_.erase(it);
    } else {
      ++it;
    }
  }
}

void NetworkMatrix::RecordLinkRate(const std::string& worker, const std::string& peer_address,
                                   double rate_bps, int64_t now_ms) {
  if (!Plausible(0, rate_bps) || rate_bps <= 0) return;
  absl::MutexLock lock(&mu_);
  auto peer = worker_at_.find(peer_address);
  if (peer == worker_at_.end() || peer->second == worker) return;
  const std::string& peer_worker = peer->second;
  Entry& entry = entries_[{worker, peer_worker}];
  incoming_.insert({peer_worker, worker});
  entry.rate_bps = rate_bps;
  entry.updated_ms = now_ms;
  entry.source = entry.rtt_s > 0 ? "probe+link" : "link";  // RTT from a probe, rate live
}

std::vector<const WorkerRecord*> NetworkMatrix::MeasuredPeersLocked(
    const std::string& worker, const std::vector<const WorkerRecord*>& sample) const {
  std::vector<const WorkerRecord*> measured;
  for (const WorkerRecord* peer : sample) {
    auto entry = entries_.find({worker, peer->id});
    if (entry != entries_.end() && entry->second.probed_ms > 0 && entry->second.rate_bps > 0 &&
        entry->second.rtt_s > 0) {
      measured.push_back(peer);
    }
  }
  return measured;
}

std::optional<v1::AccessProbeTask> NetworkMatrix::NextAccessTask(
    const std::string& worker, const std::vector<WorkerRecord>& live, int64_t now_ms,
    uint64_t live_generation) {
  if (options_.access_peers < 2) return std::nullopt;
  const std::vector<const WorkerRecord*> sample = SampleFor(worker, live, live_generation);
  absl::MutexLock lock(&mu_);
  if (auto pending = access_pending_.find(worker); pending != access_pending_.end()) {
    if (now_ms - pending->second.sent_ms < options_.task_timeout_ms) return std::nullopt;
    access_pending_.erase(pending);
  }
  if (auto known = access_.find(worker);
      known != access_.end() && now_ms - known->second.updated_ms < options_.refresh_ms) {
    return std::nullopt;
  }
  std::vector<const WorkerRecord*> peers = MeasuredPeersLocked(worker, sample);
  if (peers.size() < 2) return std::nullopt;
  // The fastest pairs: the port, not a peer's path, should be what limits.
  std::stable_sort(peers.begin(), peers.end(), [&](const WorkerRecord* a, const WorkerRecord* b) {
    return entries_.at({worker, a->id}).rate_bps > entries_.at({worker, b->id}).rate_bps;
  });
  v1::AccessProbeTask task;
  std::vector<std::string> members = {worker};
  for (size_t i = 0; i < peers.size() && static_cast<int>(i) < options_.access_peers; ++i) {
    v1::ProbeTask* peer = task.add_peers();
    peer->set_worker_id(peers[i]->id);
    peer->set_address(peers[i]->address);
    members.push_back(peers[i]->id);
  }
  if (PortsBusyLocked(members, worker, now_ms, /*measures_too=*/true)) {
    next_check_ms_[worker] = now_ms;  // asked again at its next heartbeat
    return std::nullopt;
  }
  task.set_measure_bytes(options_.probe_bytes);
  access_pending_[worker] = {now_ms, std::move(members)};
  return task;
}

void NetworkMatrix::RecordAccess(const std::string& worker, const v1::AccessProbeResult& result,
                                 int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  auto pending = access_pending_.find(worker);
  if (pending == access_pending_.end()) return;
  access_pending_.erase(pending);
  Access& access = access_[worker];
  access = Access();
  access.updated_ms = std::max<int64_t>(now_ms, 1);
  if (!result.measured() || !Plausible(0, result.uplink_bps()) ||
      !Plausible(0, result.downlink_bps()) || result.uplink_bps() <= 0 ||
      result.downlink_bps() <= 0) {
    return;  // a failed attempt: not retried before the refresh
  }
  access.uplink_bps = result.uplink_bps();
  access.downlink_bps = result.downlink_bps();
  access.peers = result.peers();
}

bool NetworkMatrix::AccessSettled(const std::string& worker,
                                  const std::vector<WorkerRecord>& live) const {
  if (options_.access_peers < 2) return true;
  const std::vector<const WorkerRecord*> sample = SampleFor(worker, live);
  absl::MutexLock lock(&mu_);
  if (access_.count(worker) > 0) return true;
  return MeasuredPeersLocked(worker, sample).size() < 2;
}

std::optional<NetworkMatrix::Access> NetworkMatrix::AccessOf(const std::string& worker) const {
  absl::MutexLock lock(&mu_);
  return AccessOfLocked(worker);
}

std::optional<NetworkMatrix::Access> NetworkMatrix::AccessOfLocked(
    const std::string& worker) const {
  auto it = access_.find(worker);
  if (it == access_.end()) return std::nullopt;
  Access access = it->second;
  if (access.uplink_bps <= 0) return access;  // a failed attempt
  // Every pair's transfer crossed the port too: it is at least as fast as
  // the fastest of them (an access measurement that met other traffic on a
  // peer's port reads low).
  for (auto out = entries_.lower_bound({worker, ""});
       out != entries_.end() && out->first.first == worker; ++out) {
    access.uplink_bps = std::max(access.uplink_bps, out->second.rate_bps);
  }
  for (auto in = incoming_.lower_bound({worker, ""});
       in != incoming_.end() && in->first == worker; ++in) {
    auto entry = entries_.find({in->second, worker});
    if (entry != entries_.end()) {
      access.downlink_bps = std::max(access.downlink_bps, entry->second.rate_bps);
    }
  }
  return access;
}

void NetworkMatrix::FillAccess(std::vector<PlannerWorkerInfo>* workers) const {
  absl::MutexLock lock(&mu_);
  for (PlannerWorkerInfo& w : *workers) {
    std::optional<Access> access = AccessOfLocked(w.id);
    if (!access.has_value() || access->uplink_bps <= 0) continue;
    w.uplink_bps = access->uplink_bps;
    w.downlink_bps = access->downlink_bps;
  }
}

void NetworkMatrix::Forget(const std::string& worker) {
  absl::MutexLock lock(&mu_);
  access_.erase(worker);
  access_pending_.erase(worker);
  for (auto out = entries_.lower_bound({worker, ""});
       out != entries_.end() && out->first.first == worker;) {
    incoming_.erase({out->first.second, worker});
    out = entries_.erase(out);
  }
  for (auto in = incoming_.lower_bound({worker, ""});
       in != incoming_.end() && in->first == worker;) {
    entries_.erase({in->second, worker});
    in = incoming_.erase(in);
  }
  pending_.erase(worker);
  next_check_ms_.erase(worker);
  sample_bound_.erase(worker);
  samples_.erase(worker);
  if (auto addresses = addresses_of_.find(worker); addresses != addresses_of_.end()) {
    for (const std::string& address : addresses->second) {
      auto at = worker_at_.find(address);
      if (at != worker_at_.end() && at->second == worker) worker_at_.erase(at);
    }
    addresses_of_.erase(addresses);
  }
}

std::optional<NetworkMatrix::Entry> NetworkMatrix::Get(const std::string& from,
                                                       const std::string& to) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find({from, to});
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

std::vector<LinkEstimate> NetworkMatrix::LinksFor(const std::vector<WorkerRecord>& workers) const {
  const size_t n = workers.size();
  std::vector<LinkEstimate> links(n * n);
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      auto it = entries_.find({workers[i].id, workers[j].id});
      if (it == entries_.end()) continue;
      links[i * n + j] = {it->second.rtt_s, it->second.rate_bps};
    }
  }
  return links;
}

std::vector<v1::NetworkLink> NetworkMatrix::Status(int64_t now_ms) const {
  std::vector<v1::NetworkLink> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [pair, entry] : entries_) {
    if (static_cast<int>(out.size()) >= options_.max_status_entries) break;
    v1::NetworkLink link;
    link.set_from_worker(pair.first);
    link.set_to_worker(pair.second);
    link.set_rtt_s(entry.rtt_s);
    link.set_rate_bps(entry.rate_bps);
    link.set_age_s((now_ms - entry.updated_ms) / 1000.0);
    link.set_source(entry.source);
    out.push_back(std::move(link));
  }
  return out;
}

}  // namespace geotrain
