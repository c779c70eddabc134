// Which workers belong to the job, and whether their leases are current.
#ifndef GEOTRAIN_COORDINATOR_MEMBERSHIP_H_
#define GEOTRAIN_COORDINATOR_MEMBERSHIP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct WorkerRecord {
  std::string id;  // "w<join order>", unique for the coordinator's lifetime
  std::string name;
  std::string address;
  v1::DeviceInfo device;
  int join_order = 0;
  int64_t joined_ms = 0;
  int64_t last_heartbeat_ms = 0;
  uint64_t rss_bytes = 0;
  int step = 0;
  v1::StageStats stats;  // from the latest heartbeat
  bool alive = true;
  std::string end_reason;  // why it is no longer alive
  v1::MemberRole role = v1::MEMBER_ROLE_WORKER;  // a relay holds no stage
  v1::Reachability reachability;  // found at join (see ReachabilityProber)
  // The joining process's own random id, the same on each retry of its
  // join (JoinRequest.session_id); empty from older clients.
  std::string session;
  // Forward + backward seconds per sample by layer kind, as the worker timed
  // them after joining (empty until its first heartbeat that carries them).
  std::map<std::string, double> layer_seconds_per_sample;
  bool relay() const { return role == v1::MEMBER_ROLE_RELAY; }
};

// Range checks of what a joiner says about itself (INVALID_ARGUMENT naming
// the field): a name of at most 128 printable bytes, HOST:PORT of at most
// 256 bytes, a finite positive GFLOP/s, a memory size under 1 PiB, short
// device strings. A relay needs no device.
absl::Status ValidateWorkerName(const std::string& name);
absl::Status ValidateJoinRequest(const v1::JoinRequest& request);
// INVALID_ARGUMENT naming the first double or float field, at any depth,
// that is NaN or infinite.
absl::Status CheckAllFinite(const google::protobuf::Message& message);
// Every number of a heartbeat is finite (its other bounds are applied as
// it is kept: BoundedStageStats, Membership::SetLayerTimings).
absl::Status ValidateHeartbeatRequest(const v1::HeartbeatRequest& request);
// Heartbeat figures made safe to keep and show: at most 64 links and
// routes, strings cut to 256 bytes, non-finite numbers zeroed.
v1::StageStats BoundedStageStats(const v1::StageStats& stats);

// Keeps worker records and leases. A worker whose last heartbeat (or join)
// is older than the lease is dead once ExpireLeases() runs. Lookups by id
// (a heartbeat, a name) cost O(1); the lists cost O(members). Thread-safe.
class Membership {
 public:
  Membership(const Clock* clock, int64_t lease_ms);

  // Admits a worker and returns its record. `id` empty: a new id
  // ("w<n>", never reused); otherwise the worker with that id (allocated
  // by the caller), which is re-admitted with a new lease if it was known.
  //
  // Idempotent: a join with the `session` of a live member (and, with an
  // `id`, that member's id) is a retry of the join that admitted it. It
  // renews the lease and returns that member unchanged, with `*retried`
  // set; a client whose first attempt ran past its deadline gets the
  // member the attempt created instead of a second one.
  WorkerRecord Join(const std::string& name, const std::string& address,
                    const v1::DeviceInfo& device, const std::string& id = "",
                    v1::MemberRole role = v1::MEMBER_ROLE_WORKER,
                    const v1::Reachability& reachability = v1::Reachability(),
                    const std::string& session = "", bool* retried = nullptr);
  // Undoes the admission of a join whose caller gave up before the answer
  // (the RPC was cancelled): the member `id` of `session` is forgotten when
  // no other attempt of that session was answered with it. True when it
  // was forgotten.
  bool Abandon(const std::string& id, const std::string& session);
  bool Knows(const std::string& id) const;
  // The member's record; nullopt when unknown (or pruned).
  std::optional<WorkerRecord> Find(const std::string& id) const;
  // Its name, or `id` itself when unknown.
  std::string NameOf(const std::string& id) const;
  // Known, not ended, and its lease has not run out (even if ExpireLeases
  // has not run since): what may still speak for its stage.
  bool IsLive(const std::string& id) const;
  // Renews the lease. False when the worker is unknown or already dead.
  bool Heartbeat(const std::string& id, uint64_t rss_bytes, int step,
                 const v1::StageStats& stats = v1::StageStats());
  void SetReachability(const std::string& id, const v1::Reachability& reachability);
  // Keeps at most 16 kinds of names up to 32 bytes with values in
  // [1e-9, 1000] s; the rest is dropped.
  void SetLayerTimings(const std::string& id,
                       const google::protobuf::Map<std::string, double>& seconds_per_sample);
  // Ends the lease now. False when unknown or already dead.
  bool Leave(const std::string& id, const std::string& reason);
  // Marks every worker whose lease ran out as dead; returns them.
  std::vector<WorkerRecord> ExpireLeases();

  // Re-admits workers persisted by a previous coordinator: ids and join
  // order are kept, live ones get a fresh lease from now.
  // `next_number`: the persisted next_number() (ids of pruned workers are
  // not given out again).
  void Restore(std::vector<WorkerRecord> records, int next_number = 0);
  int next_number() const;
  // Changes whenever a field the coordinator's state file keeps does (a
  // join, a departure, an expiry, reachability), never on a heartbeat: a
  // snapshot of the members may be reused while it is the same.
  uint64_t persisted_version() const;

  // Forgets the oldest dead workers beyond `keep_dead` (they can no
  // longer be shown, but their ids are never given out again).
  void PruneDead(size_t keep_dead);

  // All workers admitted and not pruned, in join order.
  std::vector<WorkerRecord> Snapshot() const;
  // Live members that may hold stages (no relays).
  std::vector<WorkerRecord> LiveWorkers() const;
  // The live members that may hold stages, as the heartbeat path's peer
  // sampling needs them (who measures whom): records with id, name,
  // address, role and alive only, shared and rebuilt once after the live
  // set changes (join, leave, expiry, abandon), not per call. Light, so a
  // rebuild after each of 10,000 joins copies no device, stats or timings.
  // (A rebuild at most once a second lost a newcomer's measurements for
  // 30 s: a member that ranked its sample on the old list was not asked
  // again.)
  // `generation` (when given) names the list's lineage: within one
  // generation the list only grows at its end, so what a caller derived
  // from its first n entries stays true (NetworkMatrix's samples). Never 0.
  std::shared_ptr<const std::vector<WorkerRecord>> SharedLivePeers(
      uint64_t* generation = nullptr) const;
  std::vector<WorkerRecord> LiveRelays() const;
  // The name and resident memory of up to `most` live members, the
  // earliest joined first (the metrics log's; every member's own endpoint
  // has its own).
  std::vector<std::pair<std::string, int64_t>> LiveRss(size_t most = 64) const;
  // Up to `n` live workers other than `exclude`, in join order, those
  // reachable (or not probed) before the others: who dials a joiner back.
  // Copies only those it returns.
  std::vector<WorkerRecord> ProbeCandidates(const std::string& exclude, size_t n) const;
  int64_t lease_ms() const { return lease_ms_; }

 private:
  const Clock* clock_;
  const int64_t lease_ms_;
  WorkerRecord* FindLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const WorkerRecord* FindLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReindexLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddLivePeerLocked(const WorkerRecord& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What SharedLivePeers keeps of a member.
  static WorkerRecord LivePeerOf(const WorkerRecord& w);

  mutable absl::Mutex mu_;
  std::vector<WorkerRecord> workers_ ABSL_GUARDED_BY(mu_);  // join order
  // SharedLivePeers(): a newcomer is appended (copied first only while a
  // caller still holds the list); any other change of the live set marks
  // it stale, and it is rebuilt when next asked for.
  mutable std::shared_ptr<std::vector<WorkerRecord>> live_cache_ ABSL_GUARDED_BY(mu_);
  mutable bool live_cache_stale_ ABSL_GUARDED_BY(mu_) = false;
  mutable uint64_t live_generation_ ABSL_GUARDED_BY(mu_) = 0;  // rebuilds of live_cache_
  std::unordered_map<std::string, size_t> index_ ABSL_GUARDED_BY(mu_);  // id -> workers_[i]
  // Answers given to the current session of each member (Abandon).
  std::unordered_map<std::string, int> answered_joins_ ABSL_GUARDED_BY(mu_);
  int next_number_ ABSL_GUARDED_BY(mu_) = 0;  // of the next "w<n>"
  uint64_t persisted_version_ ABSL_GUARDED_BY(mu_) = 0;
  int next_join_order_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_MEMBERSHIP_H_
