#include "worker/models.h"

#include <torch/version.h>

#include <cmath>
#include <limits>
#include <string>

#include "common/model_profile.h"

namespace geotrain {
namespace {

constexpr int64_t kVocab = 256;  // the GPT's bytes
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

// A LLaMA parameter group named as in Hugging Face's LlamaForCausalLM
// ("self_attn" holding "q_proj", ...): names only, no forward of its own.
class Group : public torch::nn::Module {};

torch::nn::Linear Projection(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

// LLaMA's initialisation: every matrix N(0, 0.02), norms 1.
void InitLlamaWeights(torch::nn::Module& layer) {
  torch::NoGradGuard no_grad;
  for (auto& named : layer.named_parameters()) {
    if (named.key().find("norm") != std::string::npos) {
      named.value().fill_(1.0);
    } else {
      named.value().normal_(0.0, 0.02);
    }
  }
}

torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return weight * (x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

class LlamaEmbedding : public Layer {
 public:
  LlamaEmbedding(int64_t vocab, int64_t d_model) {
    auto embed = register_module("embed_tokens", std::make_shared<Group>());
    embed->register_parameter("weight", torch::empty({vocab, d_model}));
    InitLlamaWeights(*this);
    weight_ = IndexOf("embed_tokens.weight");
  }
  torch::Tensor Forward(const torch::Tensor& tokens,
                        at::ArrayRef<torch::Tensor> p) const override {
    return torch::embedding(p[weight_], tokens);
  }

 private:
  size_t weight_;
};

// One decoder block: x + attn(norm(x)), then + mlp(norm(.)). Attention is
// causal with rotary positions (Hugging Face's rotate-half layout) and
// kv_heads key/value heads shared by heads / kv_heads query heads each.
class LlamaBlock : public Layer {
 public:
  explicit LlamaBlock(const v1::LlamaModel& m)
      : width_(m.d_model()),
        heads_(m.heads()),
        kv_heads_(m.kv_heads()),
        head_dim_(m.d_model() / m.heads()),
        eps_(m.rms_norm_eps()) {
    const int64_t d = width_, kv = kv_heads_ * head_dim_, hidden = m.intermediate();
    register_module("input_layernorm", std::make_shared<Group>())
        ->register_parameter("weight", torch::empty({d}));
    auto attn = register_module("self_attn", std::make_shared<Group>());
    attn->register_module("q_proj", Projection(d, d));
    attn->register_module("k_proj", Projection(d, kv));
    attn->register_module("v_proj", Projection(d, kv));
    attn->register_module("o_proj", Projection(d, d));
    register_module("post_attention_layernorm", std::make_shared<Group>())
        ->register_parameter("weight", torch::empty({d}));
    auto mlp = register_module("mlp", std::make_shared<Group>());
    mlp->register_module("gate_proj", Projection(d, hidden));
    mlp->register_module("up_proj", Projection(d, hidden));
    mlp->register_module("down_proj", Projection(hidden, d));
    InitLlamaWeights(*this);
    for (const char* name :
         {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
          "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}) {
      index_.push_back(IndexOf(name));
    }
    // cos and sin of each position's angles, [context, head_dim]: the
    // frequencies theta^(-2i/head_dim), each twice (rotate-half layout).
    const torch::Tensor inv_freq =
        1.0 / torch::pow(m.rope_theta(),
                         torch::arange(0, head_dim_, 2, torch::kInt64).to(torch::kFloat) /
                             static_cast<double>(head_dim_));
    const torch::Tensor positions = torch::arange(m.context(), torch::kInt64).to(torch::kFloat);
    const torch::Tensor angles = torch::outer(positions, inv_freq);
    const torch::Tensor both = torch::cat({angles, angles}, -1);
    cos_ = register_buffer("rope_cos", both.cos());
    sin_ = register_buffer("rope_sin", both.sin());
  }

  torch::Tensor Forward(const torch::Tensor& x, at::ArrayRef<torch::Tensor> p) const override {
    enum { kInNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown };
    auto w = [&](int i) { return p[index_[i]]; };
    const int64_t batch = x.size(0), time = x.size(1);
    const torch::Tensor cos = cos_.slice(0, 0, time), sin = sin_.slice(0, 0, time);
    auto rotate = [&](const torch::Tensor& t) {  // [batch, heads, time, head_dim]
      const torch::Tensor first = t.slice(-1, 0, head_dim_ / 2);
      const torch::Tensor second = t.slice(-1, head_dim_ / 2, head_dim_);
      return t * cos + torch::cat({-second, first}, -1) * sin;
    };
    const torch::Tensor h = RmsNorm(x, w(kInNorm), eps_);
    torch::Tensor q = torch::linear(h, w(kQ)).view({batch, time, heads_, head_dim_}).transpose(1, 2);
    torch::Tensor k =
        torch::linear(h, w(kK)).view({batch, time, kv_heads_, head_dim_}).transpose(1, 2);
    torch::Tensor v =
        torch::linear(h, w(kV)).view({batch, time, kv_heads_, head_dim_}).transpose(1, 2);
    q = rotate(q);
    k = rotate(k);
    if (kv_heads_ < heads_) {  // each key/value head serves heads / kv_heads query heads
      k = k.repeat_interleave(heads_ / kv_heads_, 1);
      v = v.repeat_interleave(heads_ / kv_heads_, 1);
    }
    const torch::Tensor mixed =
        Attention(q, k, v).transpose(1, 2).reshape({batch, time, width_});
    const torch::Tensor y = x + torch::linear(mixed, w(kO));
    const torch::Tensor m = RmsNorm(y, w(kPostNorm), eps_);
    return y + torch::linear(torch::silu(torch::linear(m, w(kGate))) * torch::linear(m, w(kUp)),
                             w(kDown));
  }

 private:
  // Causal softmax(q k^T / sqrt(head_dim)) v.
  torch::Tensor Attention(const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v) const {
#if TORCH_VERSION_MAJOR >= 2
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/true);
#else
    const int64_t time = q.size(2);
    torch::Tensor scores =
        torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
    scores = scores.masked_fill(torch::ones({time, time}, q.options()).triu(1).to(torch::kBool),
                                -std::numeric_limits<float>::infinity());
    return torch::matmul(torch::softmax(scores, -1), v);
#endif
  }

  int64_t width_, heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<size_t> index_;
  torch::Tensor cos_, sin_;
};

class LlamaHead : public Layer {
 public:
  LlamaHead(int64_t d_model, int64_t vocab, double eps) : eps_(eps) {
    register_module("norm", std::make_shared<Group>())
        ->register_parameter("weight", torch::empty({d_model}));
    register_module("lm_head", std::make_shared<Group>())
        ->register_parameter("weight", torch::empty({vocab, d_model}));
    InitLlamaWeights(*this);
    norm_ = IndexOf("norm.weight");
    out_ = IndexOf("lm_head.weight");
  }
  torch::Tensor Forward(const torch::Tensor& x, at::ArrayRef<torch::Tensor> p) const override {
    return torch::linear(RmsNorm(x, p[norm_], eps_), p[out_]);
  }

 private:
  double eps_;
  size_t norm_, out_;
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
  if (job.has_llama()) {
    const v1::LlamaModel& m = job.llama();
    if (index == 0) return std::make_shared<LlamaEmbedding>(VocabOf(job), m.d_model());
    if (index == m.blocks() + 1) {
      auto head = std::make_shared<LlamaHead>(m.d_model(), VocabOf(job), m.rms_norm_eps());
      if (m.tie_embeddings()) {  // the head's matrix starts as the embedding's
        torch::manual_seed(LayerSeed(job.seed(), 0));
        LlamaEmbedding embedding(VocabOf(job), m.d_model());
        torch::NoGradGuard no_grad;
        head->named_parameters()["lm_head.weight"].copy_(
            embedding.named_parameters()["embed_tokens.weight"]);
      }
      return head;
    }
    return std::make_shared<LlamaBlock>(m);
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
  if (IsLanguageModel(job)) {
    return torch::nn::functional::cross_entropy(output.reshape({-1, VocabOf(job)}),
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
  return IsLanguageModel(job) ? batch * ContextOf(job) : batch;
}

}  // namespace geotrain
