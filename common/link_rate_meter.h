// Estimates the rate at which a link delivers, from the receiving end, by
// packet-train dispersion: a sender writes a message's frames back to back
// (and splits every message of some size into kTimedMessageFrames), so the
// time between the arrival of its first and its last frame is the wire time
// of the frames after the first, whether or not the link was busy before
// (TimeTrain picks the span to time). The estimate is the median of the last
// `window` samples.
//
// A message read right after the reader itself stalled (its inbox was full,
// so frames waited in buffers and may all have been read in a burst) would
// overstate the rate and is skipped.
//
// Not thread-safe; one owner (the pipeline driver) feeds and reads it.
#ifndef GEOTRAIN_COMMON_LINK_RATE_METER_H_
#define GEOTRAIN_COMMON_LINK_RATE_METER_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

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
// A receiver records at most this many frame arrivals of a message.
inline constexpr size_t kMaxTimedFrameArrivals = 64;

// When one frame of a message was read, and the payload bytes it carried.
struct FrameArrival {
  absl::Time at;
  uint64_t bytes = 0;
};

// The part of a message's packet train to time: the bytes after its start
// frame and the time from that frame's arrival to the last frame's.
struct TrainTiming {
  uint64_t trailing_bytes = 0;
  absl::Duration dispersion = absl::ZeroDuration();
};

// Of the spans from frame j to the last frame, j in the train's first half,
// the one that gives the lowest rate (spans shorter than the meter's noise
// floor aside). A reader woken late for the first frame reads it and the
// frames queued behind it in one burst, so spans that start inside that
// burst overstate the rate (a 100 Mb/s link read as 130 Mb/s on a loaded
// 2-core lab); the span from the burst's last frame does not. A late read
// of the last frame can only understate it. The price: with nothing late,
// the slowest of a few spans reads a few percent low. Empty for a train of
// fewer than 2 frames.
TrainTiming TimeTrain(const std::vector<FrameArrival>& frames);

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
