#include "deploy/wan-lab/link_shaper.h"

#include <algorithm>
#include <cmath>

namespace geotrain::wanlab {
namespace {
double SerialisationUs(double rate_bps, int64_t bytes) {
  return rate_bps <= 0 ? 0.0 : static_cast<double>(bytes) * 8e6 / rate_bps;
}
}  // namespace

int64_t LinkShaper::BacklogBytes(int64_t now_us) const {
  if (shape_.rate_bps <= 0) return 0;
  const double backlog_us = link_free_us_ - static_cast<double>(now_us);
  if (backlog_us <= 0) return 0;
  return static_cast<int64_t>(std::ceil(backlog_us * shape_.rate_bps / 8e6));
}

int64_t LinkShaper::AdmitWaitUs(int64_t now_us, int64_t bytes) const {
  if (shape_.rate_bps <= 0) return 0;
  const int64_t backlog = BacklogBytes(now_us);
  if (backlog == 0 || backlog + bytes <= shape_.queue_bytes) return 0;
  // Wait until the backlog has shrunk enough (or to zero for a huge chunk).
  const int64_t excess = std::min(backlog, backlog + bytes - shape_.queue_bytes);
  return static_cast<int64_t>(std::ceil(SerialisationUs(shape_.rate_bps, excess)));
}

int64_t LinkShaper::Admit(int64_t now_us, int64_t bytes) {
  const double now = static_cast<double>(now_us);
  // Idle time earns credit up to the burst depth: the virtual start may lie
  // in the past by at most burst / rate.
  const double earliest = now - SerialisationUs(shape_.rate_bps, shape_.burst_bytes);
  const double start = std::max(link_free_us_, earliest);
  link_free_us_ = start + SerialisationUs(shape_.rate_bps, bytes);
  const double sent = std::max(link_free_us_, now);
  last_delivery_us_ =
      std::max(last_delivery_us_, static_cast<int64_t>(std::ceil(sent)) + shape_.delay_us);
  return last_delivery_us_;
}

}  // namespace geotrain::wanlab
