// Training and held-out data, read from files that Debian packages ship.
// Microbatch g of training is a pure function of (seed, g), so any worker
// count draws the same data in the same order. Includes LibTorch.
#ifndef GEOTRAIN_WORKER_DATASETS_H_
#define GEOTRAIN_WORKER_DATASETS_H_

#include <torch/torch.h>

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

struct Batch {
  torch::Tensor inputs;
  torch::Tensor targets;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Training microbatch number `index` (0, 1, 2, ... over the whole run).
  virtual Batch TrainMicrobatch(int64_t index) = 0;
  // Held-out microbatch `index` in [0, num_eval_microbatches()).
  virtual Batch EvalMicrobatch(int64_t index) = 0;
  virtual int64_t num_eval_microbatches() const = 0;
};

// Opens the job's data set. Errors name the missing or malformed file.
absl::StatusOr<std::unique_ptr<Dataset>> OpenDataset(const v1::JobSpec& job);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_DATASETS_H_
