// Out-of-place optimizers: Step() returns new parameter tensors and leaves
// the given ones untouched, so stashed versions stay valid. State (moments)
// belongs to the optimizer and advances once per Step(); the tensors
// State() returns never change afterwards while anyone holds them (a step
// writes new ones then, and updates unshared ones in place), so a spot
// check's update audit holds a version's state without copying it. Not
// thread-safe.
#ifndef GEOTRAIN_WORKER_OPTIMIZER_H_
#define GEOTRAIN_WORKER_OPTIMIZER_H_

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/learning_rate.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

class OutOfPlaceOptimizer {
 public:
  virtual ~OutOfPlaceOptimizer() = default;
  // REQUIRES: grads[i] has params[i]'s shape. The learning rate used is
  // the job's lr times `lr_scale`.
  virtual std::vector<torch::Tensor> Step(const std::vector<torch::Tensor>& params,
                                          const std::vector<torch::Tensor>& grads,
                                          double lr_scale = 1.0) = 0;

  // Per-parameter state, in parameter order (AdamW: {m, v}; SGD: {buffer}
  // with momentum); empty before the first Step(). For checkpoints.
  virtual std::vector<std::vector<torch::Tensor>> State() const = 0;
  virtual int64_t steps() const = 0;
  // Replaces the state with one of State()'s layout (copied). An empty
  // `state` resets it. INVALID_ARGUMENT when the layout does not fit.
  virtual absl::Status Restore(const std::vector<std::vector<torch::Tensor>>& state,
                               int64_t steps) = 0;
};

// AdamW (decoupled weight decay) or SGD with momentum, as the job says.
std::unique_ptr<OutOfPlaceOptimizer> MakeOptimizer(const v1::Optimizer& spec);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_OPTIMIZER_H_
