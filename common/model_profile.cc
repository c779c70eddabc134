#include "common/model_profile.h"

namespace geotrain {
namespace {

constexpr int kFashionPixels = 28 * 28;
constexpr int kFashionClasses = 10;
constexpr int kByteVocab = 256;

// Parameters, gradients and two AdamW moments, fp32.
constexpr uint64_t kBytesPerTrainedParameter = 16;

}  // namespace

bool IsLanguageModel(const v1::JobSpec& job) { return job.has_gpt() || job.has_llama(); }

int ContextOf(const v1::JobSpec& job) {
  if (job.has_gpt()) return job.gpt().context();
  if (job.has_llama()) return job.llama().context();
  return 0;
}

int DModelOf(const v1::JobSpec& job) {
  if (job.has_gpt()) return job.gpt().d_model();
  if (job.has_llama()) return job.llama().d_model();
  return 0;
}

int64_t VocabOf(const v1::JobSpec& job) {
  if (job.has_gpt()) return kByteVocab;
  if (job.has_llama()) return job.llama().vocab() > 0 ? job.llama().vocab() : kByteVocab;
  return 0;
}

int NumLayers(const v1::JobSpec& job) {
  if (job.has_gpt()) return job.gpt().blocks() + 2;  // embed, blocks, head
  if (job.has_llama()) return job.llama().blocks() + 2;
  if (job.has_mlp()) return job.mlp().hidden_size() + 1;
  return 0;
}

std::vector<LayerProfile> ProfileLayers(const v1::JobSpec& job) {
  std::vector<LayerProfile> layers;
  const double batch = job.microbatch_size() * job.microbatches();
  if (job.has_gpt()) {
    const v1::GptModel& g = job.gpt();
    const double t = g.context(), d = g.d_model();
    const double hidden = d * g.mlp_ratio();
    LayerProfile embed;
    embed.kind = "embed";
    embed.parameter_count = static_cast<uint64_t>((kByteVocab + t) * d);
    embed.flops_per_sample = 3 * t * d;  // lookups and adds only
    embed.training_bytes = embed.parameter_count * kBytesPerTrainedParameter +
                           static_cast<uint64_t>(batch * t * d * 4);
    layers.push_back(embed);
    LayerProfile block;
    block.kind = "block";
    // Two LayerNorms (2d each), qkv (3d^2 + 3d), proj (d^2 + d), fc1
    // (dh + h), fc2 (hd + d): exact, since checkpoints are checked against it.
    block.parameter_count =
        static_cast<uint64_t>(4 * d * d + 2 * d * hidden + 9 * d + hidden);
    // 6 flops per parameter per token, plus attention scores and mixing.
    block.flops_per_sample = 6 * t * (4 * d * d + 2 * d * hidden) +
                             3 * 2 * 2 * t * t * d;
    block.training_bytes =
        block.parameter_count * kBytesPerTrainedParameter +
        static_cast<uint64_t>(batch * t * (10 * d + hidden + g.heads() * t) * 4);
    for (int i = 0; i < g.blocks(); ++i) layers.push_back(block);
    LayerProfile head;
    head.kind = "head";
    head.parameter_count = static_cast<uint64_t>(2 * d + d * kByteVocab + kByteVocab);
    head.flops_per_sample = 6 * t * d * kByteVocab;
    head.training_bytes = head.parameter_count * kBytesPerTrainedParameter +
                          static_cast<uint64_t>(batch * t * kByteVocab * 4 * 2);
    layers.push_back(head);
  } else if (job.has_llama()) {
    const v1::LlamaModel& m = job.llama();
    const double t = m.context(), d = m.d_model(), v = static_cast<double>(VocabOf(job));
    const double kv = d / m.heads() * m.kv_heads();  // width of k and of v
    const double hidden = m.intermediate();
    LayerProfile embed;
    embed.kind = "embed";
    embed.parameter_count = static_cast<uint64_t>(v * d);
    embed.flops_per_sample = t * d;  // lookups only
    embed.training_bytes = embed.parameter_count * kBytesPerTrainedParameter +
                           static_cast<uint64_t>(batch * t * d * 4);
    layers.push_back(embed);
    LayerProfile block;
    block.kind = "block";
    // Two RMSNorms (d each), q and o (d^2 each), k and v (d kv each), gate,
    // up and down (d h each); no biases. Exact.
    const double matmul_parameters = 2 * d * d + 2 * d * kv + 3 * d * hidden;
    block.parameter_count = static_cast<uint64_t>(matmul_parameters + 2 * d);
    block.flops_per_sample = 6 * t * matmul_parameters + 3 * 2 * 2 * t * t * d;
    block.training_bytes =
        block.parameter_count * kBytesPerTrainedParameter +
        static_cast<uint64_t>(batch * t * (10 * d + 4 * hidden + m.heads() * t) * 4);
    for (int i = 0; i < m.blocks(); ++i) layers.push_back(block);
    LayerProfile head;
    head.kind = "head";
    head.parameter_count = static_cast<uint64_t>(d + d * v);
    head.flops_per_sample = 6 * t * d * v;
    head.training_bytes = head.parameter_count * kBytesPerTrainedParameter +
                          static_cast<uint64_t>(batch * t * v * 4 * 2);
    layers.push_back(head);
  } else if (job.has_mlp()) {
    int in = kFashionPixels;
    for (int i = 0; i <= job.mlp().hidden_size(); ++i) {
      const int out = i < job.mlp().hidden_size() ? job.mlp().hidden(i)
                                                  : kFashionClasses;
      LayerProfile linear;
      linear.kind = "linear";
      linear.parameter_count = static_cast<uint64_t>(in) * out + out;
      linear.flops_per_sample = 6.0 * in * out;
      linear.training_bytes =
          linear.parameter_count * kBytesPerTrainedParameter +
          static_cast<uint64_t>(batch * (in + 2 * out) * 4);
      layers.push_back(linear);
      in = out;
    }
  }
  return layers;
}

std::vector<ParameterSpec> LayerParameters(const v1::JobSpec& job, int layer) {
  if (job.has_gpt()) {
    const v1::GptModel& g = job.gpt();
    const int64_t d = g.d_model(), hidden = int64_t{g.d_model()} * g.mlp_ratio();
    if (layer == 0) {
      // A module's own parameters come before its children's.
      return {{"positions", {g.context(), d}}, {"tokens.weight", {kByteVocab, d}}};
    }
    if (layer == g.blocks() + 1) {
      return {{"norm.weight", {d}}, {"norm.bias", {d}},
              {"out.weight", {kByteVocab, d}}, {"out.bias", {kByteVocab}}};
    }
    return {{"norm1.weight", {d}},         {"norm1.bias", {d}},
            {"qkv.weight", {3 * d, d}},    {"qkv.bias", {3 * d}},
            {"proj.weight", {d, d}},       {"proj.bias", {d}},
            {"norm2.weight", {d}},         {"norm2.bias", {d}},
            {"fc1.weight", {hidden, d}},   {"fc1.bias", {hidden}},
            {"fc2.weight", {d, hidden}},   {"fc2.bias", {d}}};
  }
  if (job.has_llama()) {
    const v1::LlamaModel& m = job.llama();
    const int64_t d = m.d_model(), vocab = VocabOf(job), hidden = m.intermediate();
    const int64_t kv = d / m.heads() * m.kv_heads();
    if (layer == 0) return {{"embed_tokens.weight", {vocab, d}}};
    if (layer == m.blocks() + 1) return {{"norm.weight", {d}}, {"lm_head.weight", {vocab, d}}};
    return {{"input_layernorm.weight", {d}},
            {"self_attn.q_proj.weight", {d, d}},
            {"self_attn.k_proj.weight", {kv, d}},
            {"self_attn.v_proj.weight", {kv, d}},
            {"self_attn.o_proj.weight", {d, d}},
            {"post_attention_layernorm.weight", {d}},
            {"mlp.gate_proj.weight", {hidden, d}},
            {"mlp.up_proj.weight", {hidden, d}},
            {"mlp.down_proj.weight", {d, hidden}}};
  }
  if (job.has_mlp()) {
    const int64_t in = layer == 0 ? kFashionPixels : job.mlp().hidden(layer - 1);
    const int64_t out = layer < job.mlp().hidden_size() ? job.mlp().hidden(layer) : kFashionClasses;
    return {{"linear.weight", {out, in}}, {"linear.bias", {out}}};
  }
  return {};
}

TensorSpec LayerInputSpec(const v1::JobSpec& job, int layer, int64_t batch) {
  TensorSpec spec;
  if (IsLanguageModel(job)) {
    if (layer == 0) {
      spec.shape = {batch, ContextOf(job)};
      spec.dtype = v1::DTYPE_INT64;
    } else {
      spec.shape = {batch, ContextOf(job), DModelOf(job)};
    }
  } else if (job.has_mlp()) {
    const int width = layer == 0 ? kFashionPixels : job.mlp().hidden(layer - 1);
    spec.shape = {batch, width};
  }
  return spec;
}

int64_t NumTargetClasses(const v1::JobSpec& job) {
  return IsLanguageModel(job) ? VocabOf(job) : kFashionClasses;
}

TensorSpec TargetSpec(const v1::JobSpec& job, int64_t batch) {
  TensorSpec spec;
  spec.dtype = v1::DTYPE_INT64;
  if (IsLanguageModel(job)) {
    spec.shape = {batch, ContextOf(job)};
  } else {
    spec.shape = {batch};
  }
  return spec;
}

}  // namespace geotrain
