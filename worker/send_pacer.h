// Pacing of bulk sends on a worker's uplink, which also carries its stage's
// activations and gradients: a sender asks how large its parts may be
// (PartBytes) and how long to wait before each (Reserve). Parts are what
// the pace sends in 50 ms, so that no part holds a thin uplink long: a 1
// MiB part is 1.7 s of a 5 Mb/s uplink, and the pipeline's frames queue
// behind it.
//
//   - CheckpointPacer (checkpoint_pacer.h): background checkpoint uploads,
//     at what the links leave unused.
//   - UplinkSharePacer (here): the outer sync's transfers, at a fixed share
//     of the measured uplink, so that they finish within a round without
//     taking the pipeline's bandwidth.
#ifndef GEOTRAIN_WORKER_SEND_PACER_H_
#define GEOTRAIN_WORKER_SEND_PACER_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace geotrain {

class SendPacer {
 public:
  virtual ~SendPacer() = default;
  // The most one part may carry now.
  virtual size_t PartBytes() const = 0;
  // How long to wait before sending `bytes`; reserves them (the next
  // reservation queues behind this one). Zero when unpaced.
  virtual absl::Duration Reserve(uint64_t bytes) = 0;
  // The pace now, in bytes per second; 0: unpaced (or not known yet).
  virtual double bytes_per_s() const { return 0; }
};

struct PartSizing {
  absl::Duration part_time = absl::Milliseconds(50);
  uint64_t min_part_bytes = uint64_t{16} << 10;
  uint64_t max_part_bytes = uint64_t{1} << 20;
};

// What `bytes_per_s` sends in `sizing.part_time`, within its bounds; the
// largest part when unpaced (`bytes_per_s` <= 0).
size_t PartBytesAt(double bytes_per_s, const PartSizing& sizing);

// A token bucket holding up to `burst_bytes`: what was reserved goes out at
// the rate given with each reservation. Thread-safe.
class TokenBucket {
 public:
  TokenBucket(uint64_t burst_bytes, const Clock* clock)
      : burst_bytes_(burst_bytes), clock_(clock) {}
  absl::Duration Reserve(uint64_t bytes, double bytes_per_s);

 private:
  const uint64_t burst_bytes_;
  const Clock* const clock_;
  absl::Mutex mu_;
  // When the bytes reserved so far will have gone out (ms on clock_'s
  // scale, fractional so small parts add up).
  double free_at_ms_ ABSL_GUARDED_BY(mu_) = 0;
};

// `share` of the uplink that `uplink_bytes_per_s` estimates (0: not known
// yet, and then unpaced). Thread-safe.
class UplinkSharePacer final : public SendPacer {
 public:
  UplinkSharePacer(std::function<double()> uplink_bytes_per_s, double share, const Clock* clock,
                   uint64_t burst_bytes = uint64_t{64} << 10);
  double bytes_per_s() const override;
  size_t PartBytes() const override;
  absl::Duration Reserve(uint64_t bytes) override;

 private:
  const std::function<double()> uplink_bytes_per_s_;
  const double share_;
  const PartSizing sizing_;
  TokenBucket bucket_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_SEND_PACER_H_
