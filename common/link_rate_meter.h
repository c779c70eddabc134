// Estimates the rate at which a link delivers, from the receiving end, by
// packet-train dispersion: a sender writes a message's frames back to back
// (and splits every message of some size into kTimedMessageFrames), so the
// time between the arrival of its first and its last frame is the wire time
// of the frames after the first, whether or not the link was busy before.
// The estimate is the median of the last `window` samples.
//
// A message read right after the reader itself stalled (its inbox was full,
// so frames waited in buffers and were read in a burst) would overstate the
// rate and is skipped.
//
// Not thread-safe; one owner (the pipeline driver) feeds and reads it.
#ifndef GEOTRAIN_COMMON_LINK_RATE_METER_H_
#define GEOTRAIN_COMMON_LINK_RATE_METER_H_

#include <cstddef>
#include <cstdint>
#include <deque>

#include "absl/time/time.h"

namespace geotrain {

// Messages with at least this much payload travel as kTimedMessageFrames
// frames (or 1 MiB frames, if that makes more). Timing noise at either end
// of a train (a reader woken late, a relay that hands on 16 KiB at once) is
// a fixed time, so the longer the part after the first frame, the smaller
// its share: with 2 frames a 230 KB message at 100 Mb/s read as 130 Mb/s on
// a loaded 2-core lab; 8 frames time 7/8 of the message, not 1/2.
inline constexpr size_t kMinTimedMessageBytes = 32 * 1024;
inline constexpr size_t kTimedMessageFrames = 8;

class LinkRateMeter {
 public:
  explicit LinkRateMeter(size_t window = 16) : window_(window) {}

  // A message whose frames after the first carried `trailing_bytes` and
  // arrived `dispersion` after its first frame.
  void OnMessage(uint64_t trailing_bytes, absl::Duration dispersion, bool after_stall);

  // Bits per second; 0 until a sample exists.
  double rate_bps() const;

 private:
  size_t window_;
  std::deque<double> samples_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_LINK_RATE_METER_H_
