#include "common/link_rate_meter.h"

#include <algorithm>
#include <vector>

namespace geotrain {
namespace {
// Shorter dispersions are scheduling noise, not wire time.
constexpr absl::Duration kMinDispersion = absl::Microseconds(100);
}  // namespace

TrainTiming TimeTrain(const std::vector<FrameArrival>& frames) {
  TrainTiming best;
  if (frames.size() < 2) return best;
  const absl::Time last = frames.back().at;
  uint64_t trailing = 0;
  for (size_t j = 1; j < frames.size(); ++j) trailing += frames[j].bytes;
  double best_rate = 0;
  for (size_t j = 0; j == 0 || 2 * j < frames.size(); ++j) {
    if (j > 0) trailing -= frames[j].bytes;
    const absl::Duration dispersion = last - frames[j].at;
    if (j > 0 && dispersion < kMinDispersion) break;  // later spans are shorter still
    const double rate =
        static_cast<double>(trailing) / std::max(absl::ToDoubleSeconds(dispersion), 1e-12);
    if (j == 0 || rate < best_rate) {
      best = {trailing, dispersion};
      best_rate = rate;
    }
  }
  return best;
}

void LinkRateMeter::OnMessage(uint64_t trailing_bytes, absl::Duration dispersion,
                              bool after_stall) {
  if (after_stall || trailing_bytes == 0 || dispersion < kMinDispersion) return;
  samples_.push_back(8.0 * static_cast<double>(trailing_bytes) /
                     absl::ToDoubleSeconds(dispersion));
  while (samples_.size() > window_) samples_.pop_front();
}

double LinkRateMeter::rate_bps() const {
  if (samples_.empty()) return 0.0;
  std::vector<double> sorted(samples_.begin(), samples_.end());
  std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
  return sorted[sorted.size() / 2];
}

}  // namespace geotrain
