// Who can dial whom. Peer probes: up to `peer_probes` live workers dial
// each joiner back too, and the verdict is the majority of the
// coordinator's probe and theirs (half must succeed, as Petals asks of its
// peers), given once every peer asked has answered. And relays: one that
// a broken link went through is suspended until it heartbeats again.
//
// It owns its state and lock, and knows no plan: the controller asks it
// for the usable relays when it assigns links, and acts on a changed
// verdict (an event, new links). Heartbeats with nothing for it cost an
// atomic load. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_REACHABILITY_MANAGER_H_
#define GEOTRAIN_COORDINATOR_REACHABILITY_MANAGER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "coordinator/membership.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class ReachabilityManager {
 public:
  // `membership`: not owned, must outlive this; verdicts are written to it.
  ReachabilityManager(Membership* membership, int peer_probes)
      : membership_(membership), peer_probes_(peer_probes) {}

  // Asks up to `peer_probes` live workers, reachable ones first (a public
  // host's view is the one that matters), to dial `joiner` back. Nothing
  // when the coordinator did not probe it (probes are off).
  void AskPeersToProbe(const WorkerRecord& joiner);
  // Whether any probe task waits for a heartbeat (an atomic load).
  bool HasTasks() const { return has_tasks_.load(); }
  // The probe tasks waiting for `worker`, handed over once.
  std::vector<v1::ProbeTask> TakeTasks(const std::string& worker);

  struct Verdict {
    std::string worker_id;
    v1::Reachability reachability;
    bool changed = false;  // reachable before, not now, or the other way
    std::string summary;   // "not reachable by 1 of 3 probes: ..."
  };
  // `prober`'s answer to a task it was given (others are ignored). Once
  // every peer asked has answered: the verdict, already written to the
  // membership. One verdict per join: a verdict per answer could flip back
  // and forth, and every flip re-links the plan.
  std::optional<Verdict> RecordResult(const std::string& prober, const v1::ProbeResult& result);

  // A link through `relay` broke. False when it was suspended within the
  // last second (the other end of the same link, or another of its links,
  // said so too): nothing new to act on.
  bool SuspendRelay(const std::string& relay, int64_t now_ms);
  // Live relays that are reachable and not suspended (a suspended one is
  // usable again once it heartbeats after its suspension).
  std::vector<WorkerRecord> UsableRelays() const;

  // A member that left: its pending probes and suspension go.
  void Forget(const std::string& worker_id);

 private:
  struct PeerProbes {
    v1::Reachability coordinator;       // the coordinator's own probe
    std::map<std::string, bool> asked;  // prober -> answered
    std::map<std::string, v1::ProbeResult> results;
  };

  Membership* const membership_;
  const int peer_probes_;
  mutable absl::Mutex mu_;
  std::map<std::string, PeerProbes> probes_ ABSL_GUARDED_BY(mu_);  // by joiner
  std::map<std::string, std::vector<v1::ProbeTask>> tasks_ ABSL_GUARDED_BY(mu_);  // by prober
  std::atomic<bool> has_tasks_{false};  // !tasks_.empty()
  std::map<std::string, int64_t> relay_suspended_at_ms_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_REACHABILITY_MANAGER_H_
