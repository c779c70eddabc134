#include "worker/checkpoint_pacer.h"

#include <algorithm>

namespace geotrain {

double UploadPaceFromLinks(const v1::StageStats& stats, double spare_share, double min_share) {
  double pace = 0;
  for (const v1::LinkStats& link : stats.links()) {
    const double rate = link.link_rate_bps() / 8;  // bytes/s
    if (rate <= 0) continue;
    double busy = 0;  // the share of the link its microbatches use
    if (link.compute_s_per_microbatch() > 0) {
      busy = std::clamp(link.link_s_per_microbatch() / link.compute_s_per_microbatch(), 0.0, 1.0);
    }
    const double allowed = rate * std::max(min_share, spare_share * (1 - busy));
    pace = pace == 0 ? allowed : std::min(pace, allowed);
  }
  return pace;
}

double UploadPaceFromUplink(const v1::StageStats& stats, double uplink_bytes_per_s,
                           double spare_share, double min_share) {
  if (uplink_bytes_per_s <= 0) return 0;
  double sent = 0;  // wire bytes per second of training, all links
  for (const v1::LinkStats& link : stats.links()) {
    sent += link.goodput_bps() / 8 / std::max(1.0, link.compression_ratio());
  }
  const double busy = std::clamp(sent / uplink_bytes_per_s, 0.0, 1.0);
  return uplink_bytes_per_s * std::max(min_share, spare_share * (1 - busy));
}

CheckpointPacer::CheckpointPacer(CheckpointPacingOptions options, const Clock* clock)
    : options_(options), bucket_(options.burst_bytes, clock) {}

void CheckpointPacer::Observe(const v1::StageStats& stats) {
  double pace = UploadPaceFromLinks(stats, options_.spare_share, options_.min_share);
  absl::MutexLock lock(&mu_);
  if (pace == 0 && stats.links_size() > 0) {
    pace = UploadPaceFromUplink(stats, uplink_bytes_per_s_, options_.spare_share,
                                options_.min_share);
  }
  // A stage between plans reports no links: keep the last pace it had.
  if (pace > 0) from_links_bytes_per_s_ = pace;
}

void CheckpointPacer::ObserveUplink(double bytes_per_s) {
  absl::MutexLock lock(&mu_);
  uplink_bytes_per_s_ = std::max(uplink_bytes_per_s_, bytes_per_s);
}

double CheckpointPacer::bytes_per_s() const {
  if (options_.fixed_bytes_per_s < 0) return 0;
  if (options_.fixed_bytes_per_s > 0) return options_.fixed_bytes_per_s;
  absl::MutexLock lock(&mu_);
  return from_links_bytes_per_s_;
}

double CheckpointPacer::uplink_bytes_per_s() const {
  absl::MutexLock lock(&mu_);
  return uplink_bytes_per_s_;
}

size_t CheckpointPacer::PartBytes() const { return PartBytesAt(bytes_per_s(), options_.parts); }

absl::Duration CheckpointPacer::Reserve(uint64_t bytes) {
  return bucket_.Reserve(bytes, bytes_per_s());
}

}  // namespace geotrain
