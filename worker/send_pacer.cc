#include "worker/send_pacer.h"

#include <algorithm>
#include <utility>

namespace geotrain {

size_t PartBytesAt(double bytes_per_s, const PartSizing& sizing) {
  if (bytes_per_s <= 0) return sizing.max_part_bytes;
  const double part = bytes_per_s * absl::ToDoubleSeconds(sizing.part_time);
  return static_cast<size_t>(std::clamp(part, static_cast<double>(sizing.min_part_bytes),
                                        static_cast<double>(sizing.max_part_bytes)));
}

absl::Duration TokenBucket::Reserve(uint64_t bytes, double bytes_per_s) {
  if (bytes_per_s <= 0) return absl::ZeroDuration();
  const double now_ms = static_cast<double>(clock_->NowMs());
  absl::MutexLock lock(&mu_);
  // What was reserved goes out at the rate from free_at_ms_ on; a
  // reservation waits only for what exceeds a burst.
  free_at_ms_ = std::max(free_at_ms_, now_ms) + 1e3 * static_cast<double>(bytes) / bytes_per_s;
  const double burst_ms = 1e3 * static_cast<double>(burst_bytes_) / bytes_per_s;
  const double wait_ms = free_at_ms_ - now_ms - burst_ms;
  return wait_ms > 0 ? absl::Milliseconds(wait_ms) : absl::ZeroDuration();
}

UplinkSharePacer::UplinkSharePacer(std::function<double()> uplink_bytes_per_s, double share,
                                   const Clock* clock, uint64_t burst_bytes)
    : uplink_bytes_per_s_(std::move(uplink_bytes_per_s)),
      share_(share),
      bucket_(burst_bytes, clock) {}

double UplinkSharePacer::bytes_per_s() const { return share_ * uplink_bytes_per_s_(); }

size_t UplinkSharePacer::PartBytes() const { return PartBytesAt(bytes_per_s(), sizing_); }

absl::Duration UplinkSharePacer::Reserve(uint64_t bytes) {
  return bucket_.Reserve(bytes, bytes_per_s());
}

}  // namespace geotrain
