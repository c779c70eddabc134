#include "common/hf_model_dir.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <fstream>

#include "common/files.h"
#include "common/hf_llama.h"
#include "common/job_spec.h"
#include "common/model_profile.h"

namespace geotrain {
namespace {

std::string TempDir() {
  char pattern[] = "/tmp/hf-model-dir-XXXXXX";
  return mkdtemp(pattern);
}

const char kJob[] =
    "llama { context: 16 d_model: 32 heads: 4 kv_heads: 2 blocks: 2 vocab: 300 } "
    "text {} steps: 1";

// A model directory as transformers writes it: config.json and one
// model.safetensors with every parameter (F32; value i of tensor t is
// t + i/1e4, so a misplaced tensor shows), less `skip`, with `reshape`
// flattened.
struct Model {
  std::string dir;
  std::vector<std::vector<float>> values;  // per tensor, in ProfileLayers order
};

Model WriteModel(const v1::JobSpec& job, const std::string& skip = "",
                 const std::string& reshape = "") {
  Model model{TempDir(), {}};
  std::vector<SafetensorsBlob> blobs;
  std::vector<std::vector<int64_t>> shapes;
  for (int l = 0; l < NumLayers(job); ++l) {
    for (const ParameterSpec& spec : LayerParameters(job, l)) {
      const std::string name = ExportedParameterName(job, l, spec.name);
      int64_t n = 1;
      for (int64_t d : spec.shape) n *= d;
      std::vector<float>& v = model.values.emplace_back(n);
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(model.values.size()) + i * 1e-4f;
      if (name == skip) continue;
      std::vector<int64_t> shape = spec.shape;
      if (name == reshape) shape = {n};
      blobs.push_back({name, "F32", shape,
                       std::string_view(reinterpret_cast<const char*>(v.data()), 4 * n)});
    }
  }
  EXPECT_TRUE(WriteSafetensors(model.dir + "/model.safetensors", blobs, {}).ok());
  EXPECT_TRUE(WriteFileAtomically(model.dir + "/config.json", LlamaConfigJson(job.llama())).ok());
  return model;
}

TEST(HfModelDirTest, ReadsEachLayerInTheWorkersOrder) {
  const auto job = ParseJobSpec(kJob, "test");
  ASSERT_TRUE(job.ok()) << job.status();
  const Model model = WriteModel(*job);
  auto dir = HfModelDir::Open(model.dir);
  ASSERT_TRUE(dir.ok()) << dir.status();
  size_t tensor = 0;
  for (int l = 0; l < NumLayers(*job); ++l) {
    auto layer = dir->ReadLayer(*job, l);
    ASSERT_TRUE(layer.ok()) << layer.status();
    EXPECT_EQ(layer->layer(), l);
    EXPECT_EQ(layer->step(), 0);
    EXPECT_EQ(layer->state_per_param(), 0);
    std::string expected;
    for (int p = 0; p < layer->params_size(); ++p, ++tensor) {
      const std::vector<float>& v = model.values[tensor];
      expected.append(reinterpret_cast<const char*>(v.data()), 4 * v.size());
      EXPECT_EQ(layer->params(p).payload_bytes(), 4 * v.size());
    }
    EXPECT_EQ(layer->payload(), expected) << "layer " << l;
  }
  EXPECT_EQ(tensor, model.values.size());
}

TEST(HfModelDirTest, AMissingOrMisshapenTensorIsNamed) {
  const auto job = ParseJobSpec(kJob, "test");
  const std::string q = "model.layers.1.self_attn.q_proj.weight";
  {
    auto dir = HfModelDir::Open(WriteModel(*job, /*skip=*/q).dir);
    ASSERT_TRUE(dir.ok());
    EXPECT_TRUE(dir->ReadLayer(*job, 1).ok());
    const absl::Status missing = dir->ReadLayer(*job, 2).status();
    EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(missing.message().find(q), std::string::npos) << missing;
  }
  {
    auto dir = HfModelDir::Open(WriteModel(*job, "", /*reshape=*/q).dir);
    const absl::Status shape = dir->ReadLayer(*job, 2).status();
    EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(shape.message().find("has shape [1024]; the job's model needs [32,32]"),
              std::string::npos)
        << shape;
  }
  EXPECT_EQ(HfModelDir::Open(TempDir()).status().code(), absl::StatusCode::kNotFound);
}

TEST(HfModelDirTest, AnIndexMayNotPointOutsideTheDirectory) {
  const std::string dir = TempDir();
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"model.norm.weight": "../../etc/passwd"}})";
  const absl::Status status = HfModelDir::Open(dir).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("not a plain name"), std::string::npos) << status;
}

// A job that starts from a directory takes its architecture from
// config.json; a block that disagrees is refused naming both.
TEST(HfModelDirTest, InitFromTakesTheArchitectureFromConfigJson) {
  const auto job = ParseJobSpec(kJob, "test");
  const Model model = WriteModel(*job);
  auto from = ParseJobSpec(
      "init_from: \"" + model.dir + "\" llama {} text {} steps: 1", "job.textproto");
  ASSERT_TRUE(from.ok()) << from.status();
  EXPECT_EQ(from->llama().d_model(), 32);
  EXPECT_EQ(from->llama().blocks(), 2);
  EXPECT_EQ(from->llama().vocab(), 300);
  EXPECT_EQ(from->llama().context(), 16);
  auto shorter = ParseJobSpec(
      "init_from: \"" + model.dir + "\" llama { context: 8 } text {} steps: 1", "job.textproto");
  ASSERT_TRUE(shorter.ok()) << shorter.status();
  EXPECT_EQ(shorter->llama().context(), 8);

  const absl::Status differ =
      ParseJobSpec("init_from: \"" + model.dir + "\" llama { heads: 8 } text {} steps: 1",
                   "job.textproto")
          .status();
  EXPECT_EQ(differ.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(differ.message().find("job.textproto"), std::string::npos) << differ;
  EXPECT_NE(differ.message().find("llama.heads is 8"), std::string::npos) << differ;
  EXPECT_NE(differ.message().find(model.dir + "/config.json"), std::string::npos) << differ;
  EXPECT_FALSE(ParseJobSpec("init_from: \"" + model.dir + "\" llama { context: 64 } text {} "
                            "steps: 1", "job.textproto").ok());
  EXPECT_FALSE(ParseJobSpec("init_from: \"" + model.dir + "\" gpt {} text {} steps: 1", "j").ok());
  const absl::Status nowhere =
      ParseJobSpec("init_from: \"/nonexistent/model\" llama {} text {} steps: 1", "j").status();
  EXPECT_NE(nowhere.message().find("/nonexistent/model/config.json"), std::string::npos)
      << nowhere;
}

}  // namespace
}  // namespace geotrain
