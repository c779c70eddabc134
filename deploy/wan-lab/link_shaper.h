// The timing model of one direction of an emulated WAN link: a token-bucket
// rate (bytes leave the sender's side no faster than `rate_bps`, with up to
// `burst_bytes` of credit after idle time), a fixed one-way delay added after
// serialisation, and a queue cap on bytes admitted but not yet serialised.
//
// Pure arithmetic on caller-supplied microsecond timestamps, so tests drive
// it without sleeping. Not thread-safe: one reader thread owns each shaper.
#ifndef GEOTRAIN_DEPLOY_WAN_LAB_LINK_SHAPER_H_
#define GEOTRAIN_DEPLOY_WAN_LAB_LINK_SHAPER_H_

#include <cstdint>

namespace geotrain::wanlab {

struct LinkShape {
  double rate_bps = 0;          // payload bits per second; 0: unlimited
  int64_t delay_us = 0;         // one-way delay
  int64_t burst_bytes = 16384;  // token-bucket depth
  int64_t queue_bytes = 1 << 20;  // bytes waiting to be serialised, at most
};

class LinkShaper {
 public:
  explicit LinkShaper(const LinkShape& shape) : shape_(shape) {}

  // How long a chunk of `bytes` arriving at `now_us` must wait before it may
  // join the queue (0 when the queue has room). A chunk larger than the
  // whole cap is admitted once the queue is empty.
  int64_t AdmitWaitUs(int64_t now_us, int64_t bytes) const;

  // Admits a chunk at `now_us` and returns when its last byte reaches the
  // other end (serialisation finished + delay). Delivery times never
  // decrease, so a FIFO of chunks is delivered in order.
  int64_t Admit(int64_t now_us, int64_t bytes);

  // Bytes admitted but not yet serialised at `now_us`.
  int64_t BacklogBytes(int64_t now_us) const;

  // A new rate, delay or cap for what is admitted from now on (what is
  // queued keeps its times). Delivery times still never decrease: after a
  // shorter delay, a chunk waits for the one before it.
  void SetShape(const LinkShape& shape) { shape_ = shape; }
  const LinkShape& shape() const { return shape_; }

 private:
  LinkShape shape_;
  double link_free_us_ = 0;  // when everything admitted so far is serialised
  int64_t last_delivery_us_ = 0;
};

}  // namespace geotrain::wanlab

#endif  // GEOTRAIN_DEPLOY_WAN_LAB_LINK_SHAPER_H_
