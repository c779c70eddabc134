// Time source for code that reasons about deadlines and leases, so that tests
// can drive time by hand. Implementations are thread-safe.
#ifndef GEOTRAIN_COMMON_CLOCK_H_
#define GEOTRAIN_COMMON_CLOCK_H_

#include <atomic>
#include <chrono>
#include <cstdint>

namespace geotrain {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic milliseconds since an arbitrary origin.
  virtual int64_t NowMs() const = 0;
};

class SteadyClock : public Clock {
 public:
  int64_t NowMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

// A clock that moves only when told to.
class FakeClock : public Clock {
 public:
  explicit FakeClock(int64_t start_ms = 0) : now_ms_(start_ms) {}
  int64_t NowMs() const override { return now_ms_.load(); }
  void AdvanceMs(int64_t ms) { now_ms_ += ms; }

 private:
  std::atomic<int64_t> now_ms_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_CLOCK_H_
