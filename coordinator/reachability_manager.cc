#include "coordinator/reachability_manager.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace geotrain {

void ReachabilityManager::AskPeersToProbe(const WorkerRecord& joiner) {
  if (!joiner.reachability.known()) return;  // probes are off
  const std::vector<WorkerRecord> peers =
      membership_->ProbeCandidates(joiner.id, static_cast<size_t>(peer_probes_));
  absl::MutexLock lock(&mu_);
  PeerProbes& probes = probes_[joiner.id];
  probes = PeerProbes();
  probes.coordinator = joiner.reachability;
  for (const WorkerRecord& peer : peers) {
    v1::ProbeTask task;
    task.set_worker_id(joiner.id);
    task.set_address(joiner.address);
    tasks_[peer.id].push_back(std::move(task));
    probes.asked[peer.id] = false;
  }
  has_tasks_ = !tasks_.empty();
}

std::vector<v1::ProbeTask> ReachabilityManager::TakeTasks(const std::string& worker) {
  if (!has_tasks_.load()) return {};
  absl::MutexLock lock(&mu_);
  std::vector<v1::ProbeTask> taken;
  if (auto it = tasks_.find(worker); it != tasks_.end()) {
    taken = std::move(it->second);
    tasks_.erase(it);
  }
  has_tasks_ = !tasks_.empty();
  return taken;
}

std::optional<ReachabilityManager::Verdict> ReachabilityManager::RecordResult(
    const std::string& prober, const v1::ProbeResult& result) {
  v1::Reachability own;
  std::map<std::string, v1::ProbeResult> results;
  {
    absl::MutexLock lock(&mu_);
    auto probes = probes_.find(result.worker_id());
    if (probes == probes_.end()) return std::nullopt;
    auto asked = probes->second.asked.find(prober);
    if (asked == probes->second.asked.end() || asked->second) return std::nullopt;  // not asked, or again
    asked->second = true;
    v1::ProbeResult kept = result;
    kept.set_detail(result.detail().substr(0, 200));
    probes->second.results[prober] = std::move(kept);
    if (probes->second.results.size() < probes->second.asked.size()) return std::nullopt;
    own = probes->second.coordinator;
    results = std::move(probes->second.results);
    probes_.erase(probes);  // one verdict per join
  }
  int yes = own.reachable() ? 1 : 0, all = 1;
  std::string peers;
  for (const auto& [id, r] : results) {
    yes += r.reachable() ? 1 : 0;
    ++all;
    absl::StrAppend(&peers, peers.empty() ? "" : ", ", membership_->NameOf(id),
                    r.reachable() ? " dialled it" : " could not (" + r.detail() + ")");
  }
  Verdict verdict;
  verdict.worker_id = result.worker_id();
  verdict.reachability.set_known(true);
  verdict.reachability.set_reachable(2 * yes >= all);
  verdict.reachability.set_detail(absl::StrCat(own.detail(), "; peers: ", peers));
  const std::optional<WorkerRecord> before = membership_->Find(result.worker_id());
  verdict.changed = before.has_value() &&
                    before->reachability.reachable() != verdict.reachability.reachable();
  membership_->SetReachability(result.worker_id(), verdict.reachability);
  verdict.summary = absl::StrCat(verdict.reachability.reachable() ? "reachable" : "not reachable",
                                 " by ", yes, " of ", all,
                                 " probes: ", verdict.reachability.detail());
  return verdict;
}

bool ReachabilityManager::SuspendRelay(const std::string& relay, int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  if (auto last = relay_suspended_at_ms_.find(relay);
      last != relay_suspended_at_ms_.end() && now_ms - last->second < 1000) {
    return false;
  }
  relay_suspended_at_ms_[relay] = now_ms;
  return true;
}

std::vector<WorkerRecord> ReachabilityManager::UsableRelays() const {
  std::vector<WorkerRecord> live = membership_->LiveRelays();
  absl::MutexLock lock(&mu_);
  std::vector<WorkerRecord> relays;
  for (WorkerRecord& r : live) {
    auto suspended = relay_suspended_at_ms_.find(r.id);
    if (suspended != relay_suspended_at_ms_.end() && r.last_heartbeat_ms <= suspended->second) {
      continue;
    }
    if (r.reachability.known() && !r.reachability.reachable()) continue;
    relays.push_back(std::move(r));
  }
  return relays;
}

void ReachabilityManager::Forget(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  probes_.erase(worker_id);
  tasks_.erase(worker_id);
  relay_suspended_at_ms_.erase(worker_id);
  has_tasks_ = !tasks_.empty();
}

}  // namespace geotrain
