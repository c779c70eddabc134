#include "common/hf_llama.h"

#include <gtest/gtest.h>

#include "common/job_spec.h"

namespace geotrain {
namespace {

v1::LlamaModel Small() {
  auto job = ParseJobSpec(
      "llama { context: 64 d_model: 128 heads: 4 kv_heads: 2 blocks: 3 vocab: 1000 } text {} "
      "steps: 1",
      "test");
  EXPECT_TRUE(job.ok()) << job.status();
  return job->llama();
}

TEST(HfLlamaTest, ParameterNamesAreLlamaForCausalLMs) {
  const v1::LlamaModel m = Small();
  EXPECT_EQ(HfParameterName(m, 0, "embed_tokens.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(HfParameterName(m, 1, "self_attn.q_proj.weight"),
            "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(HfParameterName(m, 3, "mlp.down_proj.weight"), "model.layers.2.mlp.down_proj.weight");
  EXPECT_EQ(HfParameterName(m, 4, "norm.weight"), "model.norm.weight");
  EXPECT_EQ(HfParameterName(m, 4, "lm_head.weight"), "lm_head.weight");
}

TEST(HfLlamaTest, AConfigRoundTripsAndDisagreementsNameBoth) {
  const v1::LlamaModel m = Small();
  const std::string json = LlamaConfigJson(m);
  EXPECT_NE(json.find("\"LlamaForCausalLM\""), std::string::npos);
  absl::StatusOr<v1::LlamaModel> back = LlamaFromConfigJson(json, "dir/config.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), m.SerializeAsString());

  EXPECT_TRUE(CheckLlamaAgainstConfig(v1::LlamaModel(), *back, "dir/config.json").ok());
  v1::LlamaModel block;
  block.set_d_model(256);
  const absl::Status differ = CheckLlamaAgainstConfig(block, *back, "dir/config.json");
  EXPECT_EQ(differ.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(differ.message(),
            "the job's llama.d_model is 256 but dir/config.json has hidden_size 128");
}

TEST(HfLlamaTest, ConfigsGeotrainCannotRunAreRefused) {
  for (const char* bad : {
           "not json",
           R"({"model_type": "gpt2", "hidden_size": 8})",
           R"({"model_type": "llama", "hidden_size": 8})",  // lacks the rest
           R"({"model_type": "llama", "hidden_size": -8, "intermediate_size": 8,
               "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 10,
               "max_position_embeddings": 8})",
           R"({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
               "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 10,
               "max_position_embeddings": 8, "rope_scaling": {"type": "linear"}})",
           R"({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
               "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 10,
               "max_position_embeddings": 8, "attention_bias": true})"}) {
    absl::StatusOr<v1::LlamaModel> refused = LlamaFromConfigJson(bad, "x/config.json");
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_EQ(refused.status().message().rfind("x/config.json: ", 0), 0u) << refused.status();
  }
}

}  // namespace
}  // namespace geotrain
