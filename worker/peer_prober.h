// Dials other members back when the coordinator asks (HeartbeatResponse.
// probes: reachability, or RTT and rate for the link matrix), on a thread of
// its own so that a heartbeat never waits for a
// probe, and hands the results to the next heartbeat. At most kMaxPending
// probes wait; more are dropped (the coordinator only asks for a few).
// Thread-safe.
#ifndef GEOTRAIN_WORKER_PEER_PROBER_H_
#define GEOTRAIN_WORKER_PEER_PROBER_H_

#include <deque>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transport_security.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class PeerProber {
 public:
  static constexpr size_t kMaxPending = 8;

  explicit PeerProber(absl::Duration deadline = absl::Seconds(2)) : deadline_(deadline) {}
  ~PeerProber();
  // REQUIRES: before the first Enqueue.
  void UseSecurity(const TransportSecurity& security) { security_ = security; }
  // Measure tasks dial where a link would (--route: peer address -> via).
  // REQUIRES: before the first Enqueue.
  void UseRoutes(std::map<std::string, std::string> routes) { routes_ = std::move(routes); }

  void Enqueue(const v1::ProbeTask& task);
  std::vector<v1::ProbeResult> TakeResults();
  // An access measurement (MeasureAccess), on the same thread as the
  // probes so that none of them shares the port with another; a second
  // one while one waits replaces it.
  void EnqueueAccess(const v1::AccessProbeTask& task);
  std::vector<v1::AccessProbeResult> TakeAccessResults();

 private:
  void Loop();
  void Measure(const v1::ProbeTask& task);
  void MeasureAccessLink(const v1::AccessProbeTask& task);
  std::string RouteTo(const std::string& address) const;

  const absl::Duration deadline_;
  TransportSecurity security_;
  std::map<std::string, std::string> routes_;
  absl::Mutex mu_;
  std::deque<v1::ProbeTask> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ProbeResult> results_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::AccessProbeTask> access_pending_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::AccessProbeResult> access_results_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started by the first Enqueue
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_PEER_PROBER_H_
