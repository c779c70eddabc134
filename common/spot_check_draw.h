// Which computations a spot check audits (docs/verification.md).
//
// The coordinator holds a secret check key and never sends it. The stage-k
// computation of microbatch m in plan epoch e is audited when
//
//   HMAC-SHA256(key, "geotrain.spot-check.v1" || u64 e || u64 m || u64 k)
//
// read as a fraction of 2^64 (its first 8 bytes, big-endian) falls below
// the job's fraction f. Without the key no worker can tell which of its
// microbatches will be checked, so lying only on the others does not help;
// with it, anyone replaying the evidence can confirm that a check was drawn,
// not picked to target a worker. Torch-free and thread-safe.
#ifndef GEOTRAIN_COMMON_SPOT_CHECK_DRAW_H_
#define GEOTRAIN_COMMON_SPOT_CHECK_DRAW_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace geotrain {

inline constexpr size_t kSpotCheckKeyBytes = 32;

class SpotCheckDraw {
 public:
  // INVALID_ARGUMENT unless `key` has kSpotCheckKeyBytes bytes and
  // 0 <= `fraction` <= 1.
  static absl::StatusOr<SpotCheckDraw> Create(std::string key, double fraction);
  // A fresh key from the system's CSPRNG (OpenSSL RAND_bytes); INTERNAL if
  // it has none.
  static absl::StatusOr<std::string> NewKey();

  // Whether stage `stage`'s computation of `microbatch` in `epoch` is
  // audited. Deterministic for a key.
  bool Chosen(uint64_t epoch, uint64_t microbatch, int stage) const;
  // The draw as a number in [0, 1): Chosen() is `Draw() < fraction`.
  double Draw(uint64_t epoch, uint64_t microbatch, int stage) const;

  double fraction() const { return fraction_; }

 private:
  SpotCheckDraw(std::string key, double fraction)
      : key_(std::move(key)), fraction_(fraction) {}

  std::string key_;
  double fraction_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_SPOT_CHECK_DRAW_H_
