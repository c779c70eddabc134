// Paces a worker's background checkpoint uploads so that they never take
// the bandwidth its pipeline links need. A home uplink carries both the
// stage's links and the upload to the coordinator; an unpaced upload of a
// few hundred megabytes would delay every activation and gradient behind it.
//
// The pace follows the links as the stage measures them (LinkStats, each
// heartbeat): of each link with a known rate, the share its microbatches do
// not use (1 - link time / compute time per microbatch), times
// `spare_share`, but never below `min_share` of the link's rate, so that a
// checkpoint of a link-bound stage still completes; the slowest link sets
// the pace. Links whose messages are too small to time (an int8 MLP's 16
// KB activations) have no rate; then the uplink as measured toward peers
// (the coordinator's measure tasks, ObserveUplink) sets it: of that
// capacity, the share all the links' sent bytes leave, times
// `spare_share`, never below `min_share`. With no rate known at all (no
// link, nothing measured) uploads are not paced. A fixed rate
// (`fixed_bytes_per_s`, the worker's --checkpoint_upload_mbit) overrides
// all of that.
//
// The pacer is a token bucket (TokenBucket): Reserve(bytes) says how
// long to wait before sending `bytes`. A paced stream sends parts of
// PartBytes(): what the pace sends in `part_time`, so that no part holds
// the uplink long. (Parts of 1 MiB went out at the link's full rate, each
// 1.7 s of a 5 Mb/s uplink; a checkpoint every 10 steps stopped the
// pipeline for about 2 s each time and cost it more than half its
// samples/s in bench/pipelines --churn.) Time comes from a Clock, so
// tests drive it by hand. Thread-safe (the heartbeat thread observes, the
// uploader reserves).
#ifndef GEOTRAIN_WORKER_CHECKPOINT_PACER_H_
#define GEOTRAIN_WORKER_CHECKPOINT_PACER_H_

#include <cstddef>
#include <cstdint>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "geotrain/v1/coordinator.pb.h"
#include "worker/send_pacer.h"

namespace geotrain {

struct CheckpointPacingOptions {
  // Bytes per second for every upload; 0: from the links, < 0: unpaced.
  double fixed_bytes_per_s = 0;
  double spare_share = 0.5;  // of what the links leave unused
  double min_share = 0.05;   // of the slowest link's rate, at the least
  // What may go out at once after an idle period (at least one part).
  uint64_t burst_bytes = uint64_t{64} << 10;
  PartSizing parts;
};

class CheckpointPacer final : public SendPacer {
 public:
  // `clock` is not owned and must outlive the pacer.
  CheckpointPacer(CheckpointPacingOptions options, const Clock* clock);

  // Takes the stage's link figures (a heartbeat's StageStats).
  void Observe(const v1::StageStats& stats);
  // A measured rate from this worker to a peer (bytes/s): the uplink is at
  // least that fast. The fastest seen stands for the uplink.
  void ObserveUplink(double bytes_per_s);
  // Bytes per second uploads may use now; 0: unpaced.
  double bytes_per_s() const override;
  // The fastest rate measured from this worker to a peer (0: none yet).
  double uplink_bytes_per_s() const;
  size_t PartBytes() const override;
  absl::Duration Reserve(uint64_t bytes) override;

 private:
  const CheckpointPacingOptions options_;
  mutable absl::Mutex mu_;
  double from_links_bytes_per_s_ ABSL_GUARDED_BY(mu_) = 0;
  double uplink_bytes_per_s_ ABSL_GUARDED_BY(mu_) = 0;
  TokenBucket bucket_;
};

// The pace the links of `stats` leave for uploads (bytes/s; 0: unknown).
double UploadPaceFromLinks(const v1::StageStats& stats, double spare_share, double min_share);
// The pace an uplink of `uplink_bytes_per_s` leaves once the links of
// `stats` have sent what they send (bytes/s).
double UploadPaceFromUplink(const v1::StageStats& stats, double uplink_bytes_per_s,
                           double spare_share, double min_share);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_CHECKPOINT_PACER_H_
