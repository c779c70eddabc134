// The models geotrain trains, as lists of partitioning units ("layers"):
//   GPT: byte embedding (+ positions), N transformer blocks, final norm + head.
//   LLaMA: token embedding, N decoder blocks (RMSNorm, rotary positions,
//     grouped-query attention, SwiGLU), final RMSNorm + head; parameters
//     named as in Hugging Face's LlamaForCausalLM, without the "model." and
//     "model.layers.<i>." prefixes.
//   MLP: one Linear(+ReLU) per layer, for Fashion-MNIST.
// Layer i is initialised from (job seed, i) alone, so any worker that builds
// layer i gets the same weights (a tied head: the embedding's, from (seed, 0)). Includes LibTorch: only compute code uses it.
#ifndef GEOTRAIN_WORKER_MODELS_H_
#define GEOTRAIN_WORKER_MODELS_H_

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "geotrain/v1/job.pb.h"

namespace geotrain {

// One partitioning unit: a single tensor in and out. The module owns the
// initial parameters; Forward() is functional so that a stage can run it with
// any stashed weight version (no in-place parameter swaps under live graphs).
class Layer : public torch::nn::Module {
 public:
  // `params` are this layer's parameters in the order of parameters().
  virtual torch::Tensor Forward(const torch::Tensor& input,
                                at::ArrayRef<torch::Tensor> params) const = 0;
  torch::Tensor forward(const torch::Tensor& input) { return Forward(input, parameters()); }

 protected:
  // Position of the parameter `name` in parameters(); call after registering.
  size_t IndexOf(const std::string& name) const;
};

// Builds layers [begin, end) of the job's model on the CPU.
std::vector<std::shared_ptr<Layer>> BuildLayers(const v1::JobSpec& job,
                                                int begin, int end);

// Mean loss of the model's output against `targets`.
torch::Tensor ComputeLoss(const v1::JobSpec& job, const torch::Tensor& output,
                          const torch::Tensor& targets);

// Number of correct predictions as an int64 scalar tensor on the output's
// device (classifiers), or an undefined tensor when not a classifier.
torch::Tensor CountCorrect(const v1::JobSpec& job, const torch::Tensor& output,
                           const torch::Tensor& targets);

// Elements that a loss is averaged over in one microbatch of `batch` samples.
int64_t LossElements(const v1::JobSpec& job, int64_t batch);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_MODELS_H_
