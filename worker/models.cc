#include "worker/models.h"

#include <cmath>

namespace geotrain {
namespace {

constexpr int64_t kVocab = 256;
constexpr int64_t kPixels = 28 * 28;
constexpr int64_t kClasses = 10;

class GptEmbedding : public Layer {
 public:
  GptEmbedding(int64_t context, int64_t d_model) {
    tokens_ = register_module("tokens", torch::nn::Embedding(kVocab, d_model));
    torch::nn::init::normal_(tokens_->weight, 0.0, 0.02);
    positions_ = register_parameter("positions",
                                    torch::randn({context, d_model}) * 0.02);
  }
  torch::Tensor forward(const torch::Tensor& tokens) override {
    return tokens_->forward(tokens) +
           positions_.slice(0, 0, tokens.size(1)).unsqueeze(0);
  }

 private:
  torch::nn::Embedding tokens_{nullptr};
  torch::Tensor positions_;
};

class GptBlock : public Layer {
 public:
  GptBlock(int64_t context, int64_t d_model, int64_t heads, int64_t mlp_ratio)
      : heads_(heads) {
    norm1_ = register_module("norm1", torch::nn::LayerNorm(
                                          torch::nn::LayerNormOptions({d_model})));
    qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
    proj_ = register_module("proj", torch::nn::Linear(d_model, d_model));
    norm2_ = register_module("norm2", torch::nn::LayerNorm(
                                          torch::nn::LayerNormOptions({d_model})));
    fc1_ = register_module("fc1", torch::nn::Linear(d_model, mlp_ratio * d_model));
    fc2_ = register_module("fc2", torch::nn::Linear(mlp_ratio * d_model, d_model));
    future_ = register_buffer(
        "future", torch::triu(torch::ones({context, context}), 1).to(torch::kBool));
  }

  torch::Tensor forward(const torch::Tensor& x) override {
    const int64_t batch = x.size(0), time = x.size(1), width = x.size(2);
    const int64_t head_dim = width / heads_;
    torch::Tensor qkv = qkv_->forward(norm1_->forward(x))
                            .view({batch, time, 3, heads_, head_dim})
                            .permute({2, 0, 3, 1, 4});
    torch::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
    torch::Tensor scores =
        torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    scores = scores.masked_fill(future_.slice(0, 0, time).slice(1, 0, time),
                                -std::numeric_limits<float>::infinity());
    torch::Tensor mixed = torch::matmul(torch::softmax(scores, -1), v)
                              .transpose(1, 2)
                              .reshape({batch, time, width});
    torch::Tensor h = x + proj_->forward(mixed);
    return h + fc2_->forward(torch::gelu(fc1_->forward(norm2_->forward(h))));
  }

 private:
  int64_t heads_;
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
  torch::Tensor future_;
};

class GptHead : public Layer {
 public:
  explicit GptHead(int64_t d_model) {
    norm_ = register_module("norm", torch::nn::LayerNorm(
                                        torch::nn::LayerNormOptions({d_model})));
    out_ = register_module("out", torch::nn::Linear(d_model, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return out_->forward(norm_->forward(x));
  }

 private:
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear out_{nullptr};
};

class DenseLayer : public Layer {
 public:
  DenseLayer(int64_t in, int64_t out, bool relu) : relu_(relu) {
    linear_ = register_module("linear", torch::nn::Linear(in, out));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    torch::Tensor y = linear_->forward(x);
    return relu_ ? torch::relu(y) : y;
  }

 private:
  bool relu_;
  torch::nn::Linear linear_{nullptr};
};

// Seed of layer `index`: a fixed mix of the job seed and the index.
uint64_t LayerSeed(uint64_t job_seed, int index) {
  uint64_t x = job_seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index) + 1;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  return x & ((1ull << 62) - 1);
}

std::shared_ptr<Layer> BuildLayer(const v1::JobSpec& job, int index) {
  torch::manual_seed(LayerSeed(job.seed(), index));
  if (job.has_gpt()) {
    const v1::GptModel& g = job.gpt();
    if (index == 0) return std::make_shared<GptEmbedding>(g.context(), g.d_model());
    if (index == g.blocks() + 1) return std::make_shared<GptHead>(g.d_model());
    return std::make_shared<GptBlock>(g.context(), g.d_model(), g.heads(),
                                      g.mlp_ratio());
  }
  const auto& hidden = job.mlp().hidden();
  const int64_t in = index == 0 ? kPixels : hidden[index - 1];
  const bool last = index == hidden.size();
  return std::make_shared<DenseLayer>(in, last ? kClasses : hidden[index], !last);
}

}  // namespace

std::vector<std::shared_ptr<Layer>> BuildLayers(const v1::JobSpec& job,
                                                int begin, int end) {
  std::vector<std::shared_ptr<Layer>> layers;
  for (int i = begin; i < end; ++i) layers.push_back(BuildLayer(job, i));
  return layers;
}

torch::Tensor ComputeLoss(const v1::JobSpec& job, const torch::Tensor& output,
                          const torch::Tensor& targets) {
  if (job.has_gpt()) {
    return torch::nn::functional::cross_entropy(output.reshape({-1, kVocab}),
                                                targets.reshape({-1}));
  }
  return torch::nn::functional::cross_entropy(output, targets);
}

int64_t CountCorrect(const v1::JobSpec& job, const torch::Tensor& output,
                     const torch::Tensor& targets) {
  if (!job.has_mlp()) return -1;
  return output.argmax(1).eq(targets).sum().item<int64_t>();
}

int64_t LossElements(const v1::JobSpec& job, int64_t batch) {
  return job.has_gpt() ? batch * job.gpt().context() : batch;
}

}  // namespace geotrain
