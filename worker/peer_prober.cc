#include "worker/peer_prober.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/stage_probe.h"

namespace geotrain {

PeerProber::~PeerProber() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void PeerProber::Enqueue(const v1::ProbeTask& task) {
  absl::MutexLock lock(&mu_);
  if (pending_.size() >= kMaxPending) return;
  pending_.push_back(task);
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void PeerProber::EnqueueAccess(const v1::AccessProbeTask& task) {
  absl::MutexLock lock(&mu_);
  access_pending_ = task;
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

std::vector<v1::AccessProbeResult> PeerProber::TakeAccessResults() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::AccessProbeResult> out;
  out.swap(access_results_);
  return out;
}

std::string PeerProber::RouteTo(const std::string& address) const {
  auto route = routes_.find(address);
  return route == routes_.end() ? address : route->second;
}

std::vector<v1::ProbeResult> PeerProber::TakeResults() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::ProbeResult> out;
  out.swap(results_);
  return out;
}

void PeerProber::Loop() {
  while (true) {
    v1::ProbeTask task;
    std::optional<v1::AccessProbeTask> access;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !pending_.empty() || access_pending_.has_value();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      if (pending_.empty()) {
        access.swap(access_pending_);
      } else {
        task = pending_.front();
        pending_.pop_front();
      }
    }
    if (access.has_value()) {
      MeasureAccessLink(*access);
      continue;
    }
    if (task.measure_bytes() > 0) {
      Measure(task);
      continue;
    }
    absl::StatusOr<absl::Duration> took =
        ProbeStage(task.address(), task.worker_id(), security_, deadline_);
    v1::ProbeResult result;
    result.set_worker_id(task.worker_id());
    result.set_reachable(took.ok());
    result.set_detail(took.ok() ? absl::StrCat("in ", absl::FormatDuration(*took))
                                : std::string(took.status().message()));
    GT_LOG(Info) << "probed " << task.worker_id() << " at " << task.address() << ": "
                 << (took.ok() ? "reachable " : "not reachable: ") << result.detail();
    absl::MutexLock lock(&mu_);
    results_.push_back(std::move(result));
  }
}

void PeerProber::MeasureAccessLink(const v1::AccessProbeTask& task) {
  std::vector<MeasureTarget> targets;
  for (int i = 0; i < std::min<int>(task.peers_size(), kMaxAccessPeers); ++i) {
    targets.push_back({RouteTo(task.peers(i).address()), task.peers(i).worker_id()});
  }
  const size_t bytes = std::min<size_t>(task.measure_bytes(), kMaxMeasurePayloadBytes);
  // Each direction moves the payload to every peer at once: the deadline
  // of one probe per peer and direction.
  absl::StatusOr<AccessMeasurement> measured = MeasureAccess(
      targets, security_, deadline_ * static_cast<double>(2 * std::max<size_t>(1, targets.size())),
      bytes);
  v1::AccessProbeResult result;
  result.set_peers(static_cast<int>(targets.size()));
  result.set_measured(measured.ok());
  if (measured.ok()) {
    result.set_uplink_bps(measured->uplink_bps);
    result.set_downlink_bps(measured->downlink_bps);
    result.set_detail(absl::StrFormat("up %.1f Mb/s, down %.1f Mb/s with %d peers at once",
                                      measured->uplink_bps / 1e6, measured->downlink_bps / 1e6,
                                      result.peers()));
  } else {
    result.set_detail(std::string(measured.status().message()));
  }
  GT_LOG(Info) << "measured this worker's access link: " << result.detail();
  absl::MutexLock lock(&mu_);
  access_results_.push_back(std::move(result));
}

void PeerProber::Measure(const v1::ProbeTask& task) {
  const std::string dial = RouteTo(task.address());
  const size_t bytes = std::min<size_t>(task.measure_bytes(), kMaxMeasurePayloadBytes);
  absl::StatusOr<LinkMeasurement> measured =
      MeasureStage(dial, task.worker_id(), security_, deadline_, bytes);
  v1::ProbeResult result;
  result.set_worker_id(task.worker_id());
  result.set_measured(true);
  result.set_reachable(measured.ok());
  if (measured.ok()) {
    result.set_rtt_s(measured->rtt_s);
    result.set_rate_bps(measured->rate_bps);
    result.set_detail(absl::StrFormat("%.1f ms RTT, %.1f Mb/s via %s", 1e3 * measured->rtt_s,
                                      measured->rate_bps / 1e6, dial));
  } else {
    result.set_detail(std::string(measured.status().message()));
  }
  GT_LOG(Info) << "measured " << task.worker_id() << " at " << dial << ": " << result.detail();
  absl::MutexLock lock(&mu_);
  results_.push_back(std::move(result));
}

}  // namespace geotrain
