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
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "common/link_message.h"

namespace geotrain {

// The root mean square of every float32 element of `message`'s tensors.
// INVALID_ARGUMENT for a malformed tensor (the stage refuses it anyway);
// 0 for a message without float32 tensors.
absl::StatusOr<double> FloatRms(const LinkMessage& message);

// The RMS of the messages of one sampled step, as one link received them.
struct StepRms {
  int step = 0;
  double rms = 0;
  uint32_t messages = 0;
};

// What one link received, measured two ways: a moving average of each
// training message's RMS (a figure to show), and the RMS of the messages of
// each sampled step (what replicas are compared by: every pipeline's
// receivers sample the same steps, so the figures the coordinator compares
// are of the same point in training, whenever each heartbeat left).
// Not thread-safe (the driver's thread only).
class OutputNormMeter {
 public:
  // Steps that are multiples of this are sampled.
  static constexpr int kSampleStride = 8;
  // Complete samples reported (and the one in progress kept besides).
  static constexpr size_t kReportedSamples = 16;

  // Weight of the newest message in the moving average.
  explicit OutputNormMeter(double weight = 0.1) : weight_(weight) {}

  // Measures ACTIVATION and GRADIENT messages; ignores the others and a
  // malformed one.
  void Observe(const LinkMessage& message);

  double rms() const { return rms_; }
  uint64_t messages() const { return messages_; }
  // The newest kReportedSamples sampled steps a message of a later step
  // has arrived after, oldest first.
  std::vector<StepRms> CompleteSamples() const;

 private:
  struct StepSum {
    double mean_squares = 0;  // the sum of each message's mean square
    uint32_t messages = 0;
  };
  double weight_;
  double rms_ = 0;
  uint64_t messages_ = 0;
  int newest_step_ = -1;
  std::map<int, StepSum> samples_;
  std::vector<float> scratch_;  // decoded values, reused
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_OUTPUT_NORMS_H_
