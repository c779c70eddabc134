#include "common/link_rate_meter.h"

#include <algorithm>
#include <vector>

namespace geotrain {
namespace {
// Shorter dispersions are scheduling noise, not wire time.
constexpr absl::Duration kMinDispersion = absl::Microseconds(100);
}  // namespace

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
