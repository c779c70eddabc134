#include "coordinator/model_export.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/hf_llama.h"
#include "common/job_spec.h"
#include "common/model_profile.h"
#include "common/safetensors.h"

namespace geotrain {
namespace {

// A checkpoint of `layer` whose parameter i holds the value layer*100 + i
// + step/1000 everywhere (plus AdamW state after it, as workers send).
v1::LayerCheckpoint Checkpoint(const v1::JobSpec& job, int layer, int step,
                               bool wrong_shape = false) {
  v1::LayerCheckpoint checkpoint;
  checkpoint.set_layer(layer);
  checkpoint.set_step(step);
  checkpoint.set_state_per_param(2);
  std::string payload;
  const std::vector<ParameterSpec> specs = LayerParameters(job, layer);
  for (size_t i = 0; i < specs.size(); ++i) {
    v1::TensorHeader* header = checkpoint.add_params();
    uint64_t elements = 1;
    for (int64_t d : specs[i].shape) {
      header->add_shape(d);
      elements *= d;
    }
    if (wrong_shape && i == 0) header->set_shape(0, header->shape(0) + 1);
    header->set_dtype(v1::DTYPE_FLOAT32);
    header->set_payload_bytes(elements * 4);
    const float value = layer * 100 + static_cast<float>(i) + step / 1000.0f;
    for (uint64_t e = 0; e < elements; ++e) {
      payload.append(reinterpret_cast<const char*>(&value), 4);
    }
  }
  payload += std::string(payload.size() * 2, '\0');  // m and v
  checkpoint.set_payload(payload);
  return checkpoint;
}

class ModelExportTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TempDir() + "/model_export_" +
           testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ + "/state");
    auto job = ParseJobSpec(
        "llama { context: 8 d_model: 16 heads: 4 kv_heads: 2 blocks: 2 vocab: 300 } "
        "tokens { train: \"t\" validation: \"v\" } steps: 30",
        "test");
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *job;
    auto store = CheckpointStore::Open(dir_ + "/state");
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  std::string dir_;
  v1::JobSpec job_;
  std::unique_ptr<CheckpointStore> store_;
};

TEST_F(ModelExportTest, TheNewestCompleteStepIsWrittenWithHuggingFacesNames) {
  ModelExportOptions options;
  options.out_dir = dir_ + "/out";
  EXPECT_EQ(ExportModel(job_, *store_, options).status().code(),
            absl::StatusCode::kFailedPrecondition);
  for (int layer = 0; layer < 4; ++layer) {
    ASSERT_TRUE(store_->Save(Checkpoint(job_, layer, 10)).ok());
    if (layer != 2) ASSERT_TRUE(store_->Save(Checkpoint(job_, layer, 20)).ok());
  }
  absl::StatusOr<ModelExport> exported = ExportModel(job_, *store_, options);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->step, 10);  // layer 2 has no step 20
  EXPECT_EQ(exported->files, (std::vector<std::string>{"model.safetensors", "config.json"}));
  int64_t parameters = 0;
  for (const LayerProfile& layer : ProfileLayers(job_)) parameters += layer.parameter_count;
  EXPECT_EQ(exported->parameters, parameters);

  absl::StatusOr<SafetensorsReader> file = SafetensorsReader::Open(options.out_dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->header().metadata.at("format"), "pt");
  const SafetensorsTensor* k = file->Find("model.layers.1.self_attn.k_proj.weight");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->shape, (std::vector<int64_t>{8, 16}));
  float value;
  std::memcpy(&value, file->Data(*k).data(), 4);
  EXPECT_FLOAT_EQ(value, 2 * 100 + 2 + 0.010f);  // layer 2 (block 1), parameter 2, step 10
  for (const char* name : {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                           "model.layers.0.mlp.down_proj.weight"}) {
    EXPECT_NE(file->Find(name), nullptr) << name;
  }
  std::ifstream config(options.out_dir + "/config.json");
  std::stringstream text;
  text << config.rdbuf();
  absl::StatusOr<v1::LlamaModel> back = LlamaFromConfigJson(text.str(), "config.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), job_.llama().SerializeAsString());
}

TEST_F(ModelExportTest, ALargeModelIsShardedWithAnIndex) {
  for (int layer = 0; layer < 4; ++layer) ASSERT_TRUE(store_->Save(Checkpoint(job_, layer, 5)).ok());
  ModelExportOptions options;
  options.out_dir = dir_ + "/out";
  options.max_shard_bytes = 20000;  // the embedding alone is 300 x 16 x 4 = 19200 bytes
  absl::StatusOr<ModelExport> exported = ExportModel(job_, *store_, options);
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_GT(exported->files.size(), 3u);
  EXPECT_EQ(exported->files[0], absl::StrCat("model-00001-of-0000", exported->files.size() - 2,
                                             ".safetensors"));
  std::ifstream index(options.out_dir + "/model.safetensors.index.json");
  std::stringstream text;
  text << index.rdbuf();
  EXPECT_NE(text.str().find("\"lm_head.weight\": \"model-0000"), std::string::npos) << text.str();
  EXPECT_NE(text.str().find(absl::StrCat("\"total_size\": ", exported->tensor_bytes)),
            std::string::npos);
  // Every tensor is in exactly one shard.
  int found = 0;
  for (size_t k = 0; k + 2 < exported->files.size(); ++k) {
    absl::StatusOr<SafetensorsReader> shard =
        SafetensorsReader::Open(options.out_dir + "/" + exported->files[k]);
    ASSERT_TRUE(shard.ok()) << shard.status();
    found += static_cast<int>(shard->header().tensors.size());
  }
  EXPECT_EQ(found, 1 + 9 * 2 + 2);
}

TEST_F(ModelExportTest, ACheckpointThatIsNotTheModelsLayerIsRefused) {
  for (int layer = 0; layer < 4; ++layer) {
    ASSERT_TRUE(store_->Save(Checkpoint(job_, layer, 5, /*wrong_shape=*/layer == 3)).ok());
  }
  ModelExportOptions options;
  options.out_dir = dir_ + "/out";
  absl::StatusOr<ModelExport> exported = ExportModel(job_, *store_, options);
  EXPECT_EQ(exported.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(exported.status().message().find("layer 3's parameter 0 (norm.weight)"),
            std::string::npos)
      << exported.status();
  EXPECT_FALSE(std::filesystem::exists(options.out_dir + "/model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(options.out_dir + "/model.safetensors.tmp"));
}

}  // namespace
}  // namespace geotrain
