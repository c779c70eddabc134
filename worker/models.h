// The models geotrain trains, as lists of partitioning units ("layers"):
//   GPT: byte embedding (+ positions), N transformer blocks, final norm + head.
//   MLP: one Linear(+ReLU) per layer, for Fashion-MNIST.
// Layer i is initialised from (job seed, i) alone, so any worker that builds
// layer i gets the same weights. Includes LibTorch: only compute code uses it.
#ifndef GEOTRAIN_WORKER_MODELS_H_
#define GEOTRAIN_WORKER_MODELS_H_

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "geotrain/v1/job.pb.h"

namespace geotrain {

// One partitioning unit: a module with a single tensor in and out.
class Layer : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
};

// Builds layers [begin, end) of the job's model on the CPU.
std::vector<std::shared_ptr<Layer>> BuildLayers(const v1::JobSpec& job,
                                                int begin, int end);

// Mean loss of the model's output against `targets`.
torch::Tensor ComputeLoss(const v1::JobSpec& job, const torch::Tensor& output,
                          const torch::Tensor& targets);

// Number of correct predictions (classifiers), or -1 when not a classifier.
int64_t CountCorrect(const v1::JobSpec& job, const torch::Tensor& output,
                     const torch::Tensor& targets);

// Elements that a loss is averaged over in one microbatch of `batch` samples.
int64_t LossElements(const v1::JobSpec& job, int64_t batch);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_MODELS_H_
