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
    register_module("tokens", torch::nn::Embedding(kVocab, d_model));
    register_parameter("positions", torch::randn({context, d_model}) * 0.02);
    tokens_ = IndexOf("tokens.weight");
    positions_ = IndexOf("positions");
    torch::NoGradGuard no_grad;
    parameters()[tokens_].normal_(0.0, 0.02);
  }
  torch::Tensor Forward(const torch::Tensor& tokens,
                        at::ArrayRef<torch::Tensor> p) const override {
    return torch::embedding(p[tokens_], tokens) +
           p[positions_].slice(0, 0, tokens.size(1)).unsqueeze(0);
  }

 private:
  size_t tokens_, positions_;
};

class GptBlock : public Layer {
 public:
  GptBlock(int64_t context, int64_t d_model, int64_t heads, int64_t mlp_ratio)
      : heads_(heads), width_(d_model) {
    register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
    register_module("proj", torch::nn::Linear(d_model, d_model));
    register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    register_module("fc1", torch::nn::Linear(d_model, mlp_ratio * d_model));
    register_module("fc2", torch::nn::Linear(mlp_ratio * d_model, d_model));
    future_ = register_buffer(
        "future", torch::triu(torch::ones({context, context}), 1).to(torch::kBool));
    for (const char* name : {"norm1", "qkv", "proj", "norm2", "fc1", "fc2"}) {
      weight_.push_back(IndexOf(std::string(name) + ".weight"));
      bias_.push_back(IndexOf(std::string(name) + ".bias"));
    }
  }

  torch::Tensor Forward(const torch::Tensor& x, at::ArrayRef<torch::Tensor> p) const override {
    enum { kNorm1, kQkv, kProj, kNorm2, kFc1, kFc2 };
    auto w = [&](int i) { return p[weight_[i]]; };
    auto b = [&](int i) { return p[bias_[i]]; };
    const int64_t batch = x.size(0), time = x.size(1);
    const int64_t head_dim = width_ / heads_;
    torch::Tensor h = torch::layer_norm(x, {width_}, w(kNorm1), b(kNorm1));
    torch::Tensor qkv = torch::linear(h, w(kQkv), b(kQkv))
                            .view({batch, time, 3, heads_, head_dim})
                            .permute({2, 0, 3, 1, 4});
    torch::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
    torch::Tensor scores =
        torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    scores = scores.masked_fill(future_.slice(0, 0, time).slice(1, 0, time),
                                -std::numeric_limits<float>::infinity());
    torch::Tensor mixed = torch::matmul(torch::softmax(scores, -1), v)
                              .transpose(1, 2)
                              .reshape({batch, time, width_});
    torch::Tensor y = x + torch::linear(mixed, w(kProj), b(kProj));
    torch::Tensor m = torch::layer_norm(y, {width_}, w(kNorm2), b(kNorm2));
    return y + torch::linear(torch::gelu(torch::linear(m, w(kFc1), b(kFc1))), w(kFc2), b(kFc2));
  }

 private:
  int64_t heads_, width_;
  torch::Tensor future_;
  std::vector<size_t> weight_, bias_;
};

class GptHead : public Layer {
 public:
  explicit GptHead(int64_t d_model) : width_(d_model) {
    register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    register_module("out", torch::nn::Linear(d_model, kVocab));
    norm_w_ = IndexOf("norm.weight");
    norm_b_ = IndexOf("norm.bias");
    out_w_ = IndexOf("out.weight");
    out_b_ = IndexOf("out.bias");
  }
  torch::Tensor Forward(const torch::Tensor& x, at::ArrayRef<torch::Tensor> p) const override {
    return torch::linear(torch::layer_norm(x, {width_}, p[norm_w_], p[norm_b_]), p[out_w_],
                         p[out_b_]);
  }

 private:
  int64_t width_;
  size_t norm_w_, norm_b_, out_w_, out_b_;
};

class DenseLayer : public Layer {
 public:
  DenseLayer(int64_t in, int64_t out, bool relu) : relu_(relu) {
    register_module("linear", torch::nn::Linear(in, out));
    weight_ = IndexOf("linear.weight");
    bias_ = IndexOf("linear.bias");
  }
  torch::Tensor Forward(const torch::Tensor& x, at::ArrayRef<torch::Tensor> p) const override {
    torch::Tensor y = torch::linear(x, p[weight_], p[bias_]);
    return relu_ ? torch::relu(y) : y;
  }

 private:
  bool relu_;
  size_t weight_, bias_;
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

size_t Layer::IndexOf(const std::string& name) const {
  const auto named = named_parameters();
  for (size_t i = 0; i < named.size(); ++i) {
    if (named[i].key() == name) return i;
  }
  throw std::logic_error("layer has no parameter " + name);
}

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

torch::Tensor CountCorrect(const v1::JobSpec& job, const torch::Tensor& output,
                           const torch::Tensor& targets) {
  if (!job.has_mlp()) return torch::Tensor();
  return output.argmax(1).eq(targets).sum();
}

int64_t LossElements(const v1::JobSpec& job, int64_t batch) {
  return job.has_gpt() ? batch * job.gpt().context() : batch;
}

}  // namespace geotrain
