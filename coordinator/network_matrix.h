// The coordinator's view of the network: RTT and rate per ordered pair of
// workers, each figure with its age and where it came from, and the policy
// that keeps it filled. Workers measure a bounded sample of their peers
// (Stage.Measure over the route a link would take; ProbeTask with
// measure_bytes), one task per heartbeat, and their live links' rate meters
// refresh the rates of the pairs the plan uses. Thread-safe: one mutex of
// its own, never held while anything else is.
#ifndef GEOTRAIN_COORDINATOR_NETWORK_MATRIX_H_
#define GEOTRAIN_COORDINATOR_NETWORK_MATRIX_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "coordinator/membership.h"
#include "coordinator/network_planner.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct NetworkMatrixOptions {
  int sample = 8;                      // peers each worker measures
  uint32_t probe_bytes = 256 * 1024;   // payload of one measurement
  int64_t refresh_ms = 10 * 60 * 1000; // re-measure a pair older than this
  int64_t task_timeout_ms = 30 * 1000; // a task unanswered this long is given up
  int max_status_entries = 4096;
  // Peers of an access measurement (all at once; 2 at least, or none).
  int access_peers = 3;
};

class NetworkMatrix {
 public:
  struct Entry {
    double rtt_s = 0;     // 0: not measured
    double rate_bps = 0;  // 0: not measured
    int64_t updated_ms = 0;
    int64_t probed_ms = 0;  // when last probed (answered or failed); 0: never
    std::string source;   // "probe", "link" (rate only) or "probe+link"
  };

  // A worker's access link (its port): what it sent to and fetched from
  // several peers at once (AccessProbeTask).
  struct Access {
    double uplink_bps = 0;    // 0: the last attempt failed
    double downlink_bps = 0;
    int peers = 0;
    int64_t updated_ms = 0;   // when last measured or attempted
  };

  explicit NetworkMatrix(NetworkMatrixOptions options = {}) : options_(options) {}

  // At most one measure task for `worker` (from the live workers `live`, not
  // relays): a sampled peer whose pair has no probe figure or an old one,
  // and only while no earlier task of `worker`'s is outstanding and no
  // access task loads either end's port.
  // `live_generation`: Membership::SharedLivePeers' generation of `live`,
  // which lets the sample be kept between calls (0: ranked afresh).
  std::optional<v1::ProbeTask> NextTask(const std::string& worker,
                                        const std::vector<WorkerRecord>& live, int64_t now_ms,
                                        uint64_t live_generation = 0);
  // Cheap: whether NextTask could give `worker` anything now (no task
  // outstanding, and its sample was not found fresh in the last 30 s).
  bool WantsTask(const std::string& worker, int64_t now_ms) const;
  // Which worker advertises which address (for the links' reports); a new
  // one makes every worker look for a task again.
  void Learn(const std::string& worker, const std::string& address);
  // Whether every peer of `worker`'s sample has been probed (answered or
  // failed).
  bool SampleMeasured(const std::string& worker, const std::vector<WorkerRecord>& live) const;
  // An answer to a measure task of `prober`'s; anything not asked is ignored.
  void RecordProbe(const std::string& prober, const v1::ProbeResult& result, int64_t now_ms);
  // A live link's meter: what `worker` sends to the member at `peer_address`
  // arrives at `rate_bps`.
  void RecordLinkRate(const std::string& worker, const std::string& peer_address,
                      double rate_bps, int64_t now_ms);
  void Forget(const std::string& worker);

  // At most one access measurement for `worker`: once at least two peers of
  // its sample answered its measure tasks (so they can be reached the way
  // links go), while it has no figure or an older one than the refresh,
  // while no access task of its is outstanding, and while no other task
  // (measure or access) loads the port of it or of the peers it would use:
  // it waits for them. (The worker runs its own tasks one after another.)
  std::optional<v1::AccessProbeTask> NextAccessTask(const std::string& worker,
                                                    const std::vector<WorkerRecord>& live,
                                                    int64_t now_ms,
                                                    uint64_t live_generation = 0);
  // An answer to `worker`'s access task; anything not asked is ignored, and
  // implausible figures count as a failed attempt.
  void RecordAccess(const std::string& worker, const v1::AccessProbeResult& result,
                    int64_t now_ms);
  // Whether the first plan may stop waiting for `worker`'s access figure:
  // it has one (or an attempt failed), or fewer than two peers it could
  // measure with answered.
  bool AccessSettled(const std::string& worker, const std::vector<WorkerRecord>& live) const;
  // Its access measurement, or the fastest pair measured from (into) it
  // where that is more; zeros after a failed attempt.
  std::optional<Access> AccessOf(const std::string& worker) const;
  // Each planner worker's uplink_bps and downlink_bps, by id (AccessOf).
  // Left 0 (not limited) where no access measurement succeeded.
  void FillAccess(std::vector<PlannerWorkerInfo>* workers) const;

  std::optional<Entry> Get(const std::string& from, const std::string& to) const;
  // The planner's links for `workers` (n x n, from i to j; unknown: rate 0).
  std::vector<LinkEstimate> LinksFor(const std::vector<WorkerRecord>& workers) const;
  std::vector<v1::NetworkLink> Status(int64_t now_ms) const;

 private:
  // The peers `worker` measures: the `sample` whose (worker, peer) hash is
  // lowest, so each worker has its own spread and it is stable as others
  // come and go. Pointers into `live`.
  std::vector<const WorkerRecord*> SampleFor(const std::string& worker,
                                             const std::vector<WorkerRecord>& live,
                                             uint64_t live_generation = 0) const;

  // A worker's sample as ranked on the first `ranked_upto` entries of a
  // live list of `generation`: (rank, index in the list), best first.
  struct Sample {
    uint64_t generation = 0;
    size_t ranked_upto = 0;
    std::vector<std::pair<uint64_t, size_t>> best;
  };

  const NetworkMatrixOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // entries_' keys by their second worker: (to, from), so what arrives at a
  // worker is a range as what leaves it is (AccessOf per status row).
  std::set<std::pair<std::string, std::string>> incoming_ ABSL_GUARDED_BY(mu_);
  // Outstanding measure task per prober: its target and when it was sent.
  std::map<std::string, std::pair<std::string, int64_t>> pending_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> next_check_ms_ ABSL_GUARDED_BY(mu_);
  // Per worker with a full sample: the rank of its last member (SampleFor).
  mutable std::map<std::string, uint64_t> sample_bound_ ABSL_GUARDED_BY(mu_);
  mutable std::map<std::string, Sample> samples_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> worker_at_ ABSL_GUARDED_BY(mu_);  // address -> worker
  // worker -> the addresses it was learnt at (Forget without a scan).
  std::map<std::string, std::set<std::string>> addresses_of_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Access> access_ ABSL_GUARDED_BY(mu_);
  // Outstanding access task per worker: when it was sent, and the workers
  // whose ports it loads (the worker and its peers).
  struct AccessPending {
    int64_t sent_ms = 0;
    std::vector<std::string> members;
  };
  std::map<std::string, AccessPending> access_pending_ ABSL_GUARDED_BY(mu_);
  // Whether an outstanding task other than `except`'s (an access task, or
  // with `measures_too` a measure task too; not past the task timeout)
  // loads the port of any of `members`: two measurements through one port
  // would each read part of it (a 20 Mb/s lab port read 11 Mb/s so).
  bool PortsBusyLocked(const std::vector<std::string>& members, const std::string& except,
                       int64_t now_ms, bool measures_too) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::optional<Access> AccessOfLocked(const std::string& worker) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The peers of `worker`'s sample that answered a measure with a rate.
  std::vector<const WorkerRecord*> MeasuredPeersLocked(
      const std::string& worker, const std::vector<const WorkerRecord*>& sample) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_NETWORK_MATRIX_H_
