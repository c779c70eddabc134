// The models' layers built on their own: the LLaMA decoder's names, sizes,
// causality and attention against a plain reference.
#include "worker/models.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <set>
#include <string>

#include "common/job_spec.h"
#include "common/model_profile.h"

namespace geotrain {
namespace {

v1::JobSpec Llama(const std::string& block) {
  auto job = ParseJobSpec("llama { " + block + " } text {} steps: 3 microbatch_size: 2 seed: 3",
                          "test");
  EXPECT_TRUE(job.ok()) << job.status();
  return job.ok() ? *job : v1::JobSpec();
}

std::vector<std::string> Names(const Layer& layer) {
  std::vector<std::string> names;
  for (const auto& p : layer.named_parameters()) names.push_back(p.key());
  return names;
}

TEST(LlamaModelTest, LayersAreNamedAndSizedAsLlamaForCausalLM) {
  const v1::JobSpec job =
      Llama("context: 16 d_model: 32 heads: 4 kv_heads: 2 blocks: 2 intermediate: 48");
  const std::vector<std::shared_ptr<Layer>> layers = BuildLayers(job, 0, NumLayers(job));
  ASSERT_EQ(layers.size(), 4u);
  EXPECT_EQ(Names(*layers[0]), std::vector<std::string>{"embed_tokens.weight"});
  EXPECT_EQ(Names(*layers[1]),
            (std::vector<std::string>{
                "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.down_proj.weight"}));
  EXPECT_EQ(Names(*layers[3]), (std::vector<std::string>{"norm.weight", "lm_head.weight"}));
  // Hugging Face's layouts: [out, in]; k and v have kv_heads x head_dim rows.
  const auto block = layers[1]->named_parameters();
  EXPECT_EQ(block["self_attn.k_proj.weight"].sizes(), (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(block["mlp.down_proj.weight"].sizes(), (std::vector<int64_t>{32, 48}));
  EXPECT_EQ(layers[0]->named_parameters()["embed_tokens.weight"].sizes(),
            (std::vector<int64_t>{256, 32}));
  // The profile's parameter counts are exact (checkpoints are checked
  // against them).
  const std::vector<LayerProfile> profile = ProfileLayers(job);
  for (size_t i = 0; i < layers.size(); ++i) {
    int64_t count = 0;
    for (const torch::Tensor& p : layers[i]->parameters()) count += p.numel();
    EXPECT_EQ(static_cast<uint64_t>(count), profile[i].parameter_count) << "layer " << i;
  }
  // Norms start at 1, matrices at N(0, 0.02); the same seed, the same weights.
  EXPECT_TRUE(torch::all(block["input_layernorm.weight"] == 1).item<bool>());
  const double sd = block["mlp.up_proj.weight"].std().item<double>();
  EXPECT_NEAR(sd, 0.02, 0.003);
  const auto again = BuildLayers(job, 1, 2)[0]->named_parameters();
  EXPECT_TRUE(torch::equal(again["mlp.up_proj.weight"], block["mlp.up_proj.weight"]));
}

TEST(ModelsTest, TheTorchFreeParameterListIsWhatTheLayersHold) {
  const std::string corpus = "text {} steps: 3";
  for (const std::string& model :
       {std::string("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } ") + corpus,
        std::string("llama { context: 8 d_model: 16 heads: 4 kv_heads: 2 blocks: 2 } ") + corpus,
        std::string("mlp { hidden: 12 hidden: 7 } fashion_mnist {} steps: 3")}) {
    auto job = ParseJobSpec(model, "test");
    ASSERT_TRUE(job.ok()) << job.status();
    for (int layer = 0; layer < NumLayers(*job); ++layer) {
      const auto built = BuildLayers(*job, layer, layer + 1)[0]->named_parameters();
      const std::vector<ParameterSpec> listed = LayerParameters(*job, layer);
      ASSERT_EQ(listed.size(), built.size()) << model << " layer " << layer;
      for (size_t i = 0; i < listed.size(); ++i) {
        EXPECT_EQ(listed[i].name, built[i].key()) << model << " layer " << layer;
        EXPECT_EQ(built[i].value().sizes(), listed[i].shape) << listed[i].name;
      }
    }
  }
}

TEST(LlamaModelTest, TheDefaultsAreLlamasAndBadShapesAreRefused) {
  const v1::JobSpec job = Llama("context: 8 d_model: 96 heads: 4 blocks: 1");
  EXPECT_EQ(job.llama().kv_heads(), 4);
  EXPECT_EQ(job.llama().intermediate(), 256);  // 8/3 x 96 = 256
  EXPECT_EQ(job.llama().vocab(), 256);
  EXPECT_DOUBLE_EQ(job.llama().rope_theta(), 10000);
  for (const char* bad : {"context: 8 d_model: 32 heads: 4 kv_heads: 3 blocks: 1",
                          "context: 8 d_model: 36 heads: 4 blocks: 1",  // head size 9: odd
                          "context: 8 d_model: 32 heads: 4 blocks: 1 vocab: 100",
                          "context: 0 d_model: 32 heads: 4 blocks: 1"}) {
    auto refused = ParseJobSpec(std::string("llama { ") + bad + " } text {} steps: 3", "bad.job");
    EXPECT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find("bad.job: llama"), std::string::npos)
        << refused.status();
  }
  // Tied embeddings trade gradients at each update: the sync schedule only.
  const std::string tied =
      "llama { context: 8 d_model: 32 heads: 4 blocks: 1 tie_embeddings: true } text {} steps: 3";
  EXPECT_TRUE(ParseJobSpec(tied, "tied.job").ok());
  auto async_tied = ParseJobSpec(tied + " schedule: SCHEDULE_ASYNC_STASH", "tied.job");
  ASSERT_FALSE(async_tied.ok());
  EXPECT_NE(async_tied.status().message().find("tie_embeddings needs schedule SCHEDULE_SYNC"),
            std::string::npos)
      << async_tied.status();
}

// Plain causal attention with rotary positions, head by head, as the
// Hugging Face code spells it.
torch::Tensor ReferenceBlock(const v1::LlamaModel& m, torch::OrderedDict<std::string, torch::Tensor> p,
                             const torch::Tensor& x) {
  const int64_t t = x.size(1), hd = m.d_model() / m.heads();
  auto norm = [&](const torch::Tensor& v, const torch::Tensor& w) {
    return w * (v / torch::sqrt(v.pow(2).mean(-1, true) + m.rms_norm_eps()));
  };
  torch::Tensor inv = torch::empty({hd / 2});
  for (int64_t i = 0; i < hd / 2; ++i) {
    inv[i] = 1.0 / std::pow(m.rope_theta(), 2.0 * i / hd);
  }
  const torch::Tensor angles = torch::outer(torch::arange(t).to(torch::kFloat), inv);
  const torch::Tensor cos = torch::cat({angles, angles}, -1).cos();
  const torch::Tensor sin = torch::cat({angles, angles}, -1).sin();
  auto rope = [&](const torch::Tensor& v) {  // [b, t, hd]
    const torch::Tensor rotated = torch::cat({-v.slice(-1, hd / 2), v.slice(-1, 0, hd / 2)}, -1);
    return v * cos + rotated * sin;
  };
  const torch::Tensor h = norm(x, p["input_layernorm.weight"]);
  const torch::Tensor q = torch::matmul(h, p["self_attn.q_proj.weight"].t());
  const torch::Tensor k = torch::matmul(h, p["self_attn.k_proj.weight"].t());
  const torch::Tensor v = torch::matmul(h, p["self_attn.v_proj.weight"].t());
  std::vector<torch::Tensor> heads;
  const int64_t group = m.heads() / m.kv_heads();
  for (int64_t head = 0; head < m.heads(); ++head) {
    const int64_t kv = head / group;
    const torch::Tensor qh = rope(q.slice(-1, head * hd, (head + 1) * hd));
    const torch::Tensor kh = rope(k.slice(-1, kv * hd, (kv + 1) * hd));
    const torch::Tensor vh = v.slice(-1, kv * hd, (kv + 1) * hd);
    torch::Tensor scores = torch::matmul(qh, kh.transpose(1, 2)) / std::sqrt(double(hd));
    const torch::Tensor future = torch::ones({t, t}).triu(1).to(torch::kBool);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    heads.push_back(torch::matmul(torch::softmax(scores, -1), vh));
  }
  const torch::Tensor y = x + torch::matmul(torch::cat(heads, -1), p["self_attn.o_proj.weight"].t());
  const torch::Tensor n = norm(y, p["post_attention_layernorm.weight"]);
  const torch::Tensor gate = torch::matmul(n, p["mlp.gate_proj.weight"].t());
  const torch::Tensor up = torch::matmul(n, p["mlp.up_proj.weight"].t());
  return y + torch::matmul(gate * torch::sigmoid(gate) * up, p["mlp.down_proj.weight"].t());
}

TEST(LlamaModelTest, ABlockMatchesAPlainReferenceWithGroupedQueries) {
  for (int kv_heads : {4, 2, 1}) {
    const v1::JobSpec job = Llama("context: 12 d_model: 32 heads: 4 kv_heads: " +
                                  std::to_string(kv_heads) + " blocks: 1 intermediate: 40");
    const std::shared_ptr<Layer> block = BuildLayers(job, 1, 2)[0];
    torch::manual_seed(11);
    const torch::Tensor x = torch::randn({2, 12, 32});
    torch::NoGradGuard no_grad;
    const torch::Tensor ours = block->forward(x);
    const torch::Tensor reference = ReferenceBlock(job.llama(), block->named_parameters(), x);
    EXPECT_TRUE(torch::allclose(ours, reference, 1e-5, 1e-5))
        << "kv_heads " << kv_heads << ": max diff "
        << (ours - reference).abs().max().item<double>();
  }
}

TEST(LlamaModelTest, ATokenNeverSeesTheTokensAfterIt) {
  const v1::JobSpec job = Llama("context: 10 d_model: 16 heads: 2 blocks: 2");
  const std::vector<std::shared_ptr<Layer>> layers = BuildLayers(job, 0, NumLayers(job));
  auto run = [&](torch::Tensor tokens) {
    for (const auto& layer : layers) tokens = layer->forward(tokens);
    return tokens;
  };
  torch::NoGradGuard no_grad;
  torch::Tensor tokens = torch::randint(0, 256, {1, 10}, torch::kInt64);
  const torch::Tensor before = run(tokens);
  EXPECT_EQ(before.sizes(), (std::vector<int64_t>{1, 10, 256}));
  tokens[0][6] = (tokens[0][6].item<int64_t>() + 1) % 256;
  const torch::Tensor after = run(tokens);
  EXPECT_TRUE(torch::allclose(before.slice(1, 0, 6), after.slice(1, 0, 6), 0, 1e-6));
  EXPECT_FALSE(torch::allclose(before.slice(1, 6), after.slice(1, 6)));
  // The loss is cross-entropy over the vocabulary, per token.
  const torch::Tensor targets = torch::randint(0, 256, {1, 10}, torch::kInt64);
  const double loss = ComputeLoss(job, before, targets).item<double>();
  EXPECT_NEAR(loss, std::log(256.0), 0.5);  // near uniform at initialisation
  EXPECT_EQ(LossElements(job, 3), 30);
}

}  // namespace
}  // namespace geotrain
