// The cheap check on every microbatch (docs/verification.md): the size of
// what each neighbour sends, measured by the receiver on the bytes it
// received (a sender's own report of its norms would be its word). A
// stage whose activations or gradients are far from its replicas', or from
// its own history, becomes a suspect whose computations are audited more
// often (coordinator/output_norm_watch.h).
//
// Torch-free: the payload is decoded by the codecs themselves, once more
// than the stage decodes it.
#ifndef GEOTRAIN_WORKER_OUTPUT_NORMS_H_
#define GEOTRAIN_WORKER_OUTPUT_NORMS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/link_message.h"

namespace geotrain {

// The root mean square of every float32 element of `message`'s tensors.
// INVALID_ARGUMENT for a malformed tensor (the stage refuses it anyway);
// 0 for a message without float32 tensors.
absl::StatusOr<double> FloatRms(const LinkMessage& message);

// A moving average of the RMS of the training messages one link received.
// Not thread-safe (the driver's thread only).
class OutputNormMeter {
 public:
  // Weight of the newest message in the moving average.
  explicit OutputNormMeter(double weight = 0.1) : weight_(weight) {}

  // Measures ACTIVATION and GRADIENT messages; ignores the others and a
  // malformed one.
  void Observe(const LinkMessage& message);

  double rms() const { return rms_; }
  uint64_t messages() const { return messages_; }

 private:
  double weight_;
  double rms_ = 0;
  uint64_t messages_ = 0;
  std::vector<float> scratch_;  // decoded values, reused
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_OUTPUT_NORMS_H_
