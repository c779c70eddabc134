#include "coordinator/model_export.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/hf_llama.h"
#include "common/hf_model_dir.h"
#include "common/json.h"
#include "common/model_profile.h"
#include "common/safetensors.h"
#include "google/protobuf/util/json_util.h"

namespace geotrain {
namespace {

struct Tensor {
  SafetensorsEntry entry;
  int layer = 0;
  int index = 0;  // among the layer's parameters
  uint64_t bytes = 0;
};

std::string ConfigJson(const v1::JobSpec& job) {
  if (job.has_llama()) return LlamaConfigJson(job.llama());
  std::string model;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  if (job.has_gpt()) {
    (void)google::protobuf::util::MessageToJsonString(job.gpt(), &model, options);
  } else {
    (void)google::protobuf::util::MessageToJsonString(job.mlp(), &model, options);
  }
  return absl::StrCat("{\n  \"geotrain_model\": \"", job.has_gpt() ? "gpt" : "mlp",
                      "\",\n  \"model\": ", model, ",\n  \"torch_dtype\": \"float32\"\n}\n");
}

// The parameter bytes of `checkpoint`, by index, checked against the layer.
absl::StatusOr<std::vector<std::string_view>> ParameterBytes(
    const v1::LayerCheckpoint& checkpoint, const std::vector<ParameterSpec>& specs) {
  if (checkpoint.params_size() != static_cast<int>(specs.size())) {
    return absl::DataLossError(absl::StrCat("layer ", checkpoint.layer(), "'s checkpoint holds ",
                                            checkpoint.params_size(), " parameters, not ",
                                            specs.size()));
  }
  std::vector<std::string_view> out;
  uint64_t offset = 0;
  const std::string& payload = checkpoint.payload();
  for (int i = 0; i < checkpoint.params_size(); ++i) {
    const v1::TensorHeader& header = checkpoint.params(i);
    const std::vector<int64_t> shape(header.shape().begin(), header.shape().end());
    uint64_t elements = 1;
    for (int64_t d : specs[i].shape) elements *= static_cast<uint64_t>(d);
    if (header.dtype() != v1::DTYPE_FLOAT32 || shape != specs[i].shape ||
        header.payload_bytes() != 4 * elements ||
        offset + header.payload_bytes() > payload.size()) {
      return absl::DataLossError(absl::StrCat("layer ", checkpoint.layer(), "'s parameter ", i,
                                              " (", specs[i].name,
                                              ") is not what the model holds there"));
    }
    out.emplace_back(payload.data() + offset, header.payload_bytes());
    offset += header.payload_bytes();
  }
  return out;
}

absl::Status Unavailable(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<ModelExport> ExportModel(const v1::JobSpec& job, CheckpointStore& store,
                                        const ModelExportOptions& options) {
  const int layers = NumLayers(job);
  // The newest step every layer has.
  const std::map<int, std::vector<int>> index = store.Index();
  std::optional<std::set<int>> common;
  for (int l = 0; l < layers; ++l) {
    auto it = index.find(l);
    std::set<int> steps;
    if (it != index.end()) steps.insert(it->second.begin(), it->second.end());
    if (!common.has_value()) {
      common = steps;
    } else {
      std::set<int> both;
      for (int s : steps) {
        if (common->count(s) > 0) both.insert(s);
      }
      common = both;
    }
  }
  if (!common.has_value() || common->empty()) {
    return absl::FailedPreconditionError(
        "no step has a checkpoint of every layer yet (checkpoints come every checkpoint_every "
        "steps)");
  }
  ModelExport result;
  result.step = *common->rbegin();

  std::vector<Tensor> tensors;
  for (int l = 0; l < layers; ++l) {
    const std::vector<ParameterSpec> specs = LayerParameters(job, l);
    for (size_t i = 0; i < specs.size(); ++i) {
      // A tied head is the embedding: saved once, as Hugging Face does.
      if (job.has_llama() && job.llama().tie_embeddings() && l == layers - 1 &&
          specs[i].name == "lm_head.weight") {
        continue;
      }
      Tensor t;
      t.entry.name = ExportedParameterName(job, l, specs[i].name);
      t.entry.dtype = "F32";
      t.entry.shape = specs[i].shape;
      absl::StatusOr<uint64_t> bytes = SafetensorsBytes(t.entry);
      if (!bytes.ok()) return bytes.status();
      t.bytes = *bytes;
      t.layer = l;
      t.index = static_cast<int>(i);
      result.tensor_bytes += t.bytes;
      result.parameters += static_cast<int64_t>(t.bytes / 4);
      tensors.push_back(std::move(t));
    }
  }
  // Shards in order, each up to max_shard_bytes (a tensor larger than that
  // gets one of its own).
  std::vector<std::vector<const Tensor*>> shards(1);
  uint64_t in_shard = 0;
  for (const Tensor& t : tensors) {
    if (!shards.back().empty() && in_shard + t.bytes > options.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&t);
    in_shard += t.bytes;
  }
  std::error_code error;
  std::filesystem::create_directories(options.out_dir, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", options.out_dir, ": ", error.message()));
  }
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"geotrain_step", absl::StrCat(result.step)}};
  std::map<std::string, std::string> weight_map;
  // The layer whose checkpoint is loaded (one at a time).
  int loaded_layer = -1;
  v1::LayerCheckpoint loaded;
  std::vector<std::string_view> loaded_bytes;
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name =
        shards.size() == 1 ? "model.safetensors"
                           : absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1,
                                             shards.size());
    std::vector<SafetensorsEntry> entries;
    for (const Tensor* t : shards[k]) {
      entries.push_back(t->entry);
      weight_map[t->entry.name] = name;
    }
    absl::StatusOr<std::string> header = EncodeSafetensorsHeader(entries, metadata);
    if (!header.ok()) return header.status();
    const std::string path = options.out_dir + "/" + name;
    const std::string temp = path + ".tmp";
    const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return Unavailable("cannot write " + temp);
    absl::Status written = WriteAll(fd, *header, temp);
    for (const Tensor* t : shards[k]) {
      if (!written.ok()) break;
      if (t->layer != loaded_layer) {
        absl::StatusOr<v1::LayerCheckpoint> checkpoint = store.Load(t->layer, result.step);
        if (!checkpoint.ok()) {
          written = checkpoint.status();
          break;
        }
        loaded = *std::move(checkpoint);
        absl::StatusOr<std::vector<std::string_view>> bytes =
            ParameterBytes(loaded, LayerParameters(job, t->layer));
        if (!bytes.ok()) {
          written = bytes.status();
          break;
        }
        loaded_bytes = *std::move(bytes);
        loaded_layer = t->layer;
      }
      written = WriteAll(fd, loaded_bytes[t->index], temp);
    }
    if (written.ok() && fsync(fd) != 0) written = Unavailable("fsync " + temp);
    close(fd);
    if (written.ok() && rename(temp.c_str(), path.c_str()) != 0) {
      written = Unavailable("rename " + temp);
    }
    if (!written.ok()) {
      unlink(temp.c_str());
      return written;
    }
    result.files.push_back(name);
  }
  if (shards.size() > 1) {
    std::string json = absl::StrCat("{\n  \"metadata\": {\"total_size\": ", result.tensor_bytes,
                                    "},\n  \"weight_map\": {");
    bool first = true;
    for (const auto& [tensor, file] : weight_map) {
      absl::StrAppend(&json, first ? "\n" : ",\n", "    ", JsonString(tensor), ": ",
                      JsonString(file));
      first = false;
    }
    json += "\n  }\n}\n";
    if (absl::Status ok = WriteFileAtomically(options.out_dir + "/model.safetensors.index.json",
                                              json);
        !ok.ok()) {
      return ok;
    }
    result.files.push_back("model.safetensors.index.json");
  }
  if (absl::Status ok = WriteFileAtomically(options.out_dir + "/config.json", ConfigJson(job));
      !ok.ok()) {
    return ok;
  }
  result.files.push_back("config.json");
  return result;
}

absl::StatusOr<ModelImport> ImportModel(const v1::JobSpec& job, CheckpointStore& store) {
  ModelImport result;
  if (!store.Index().empty()) return result;
  absl::StatusOr<HfModelDir> dir = HfModelDir::Open(job.init_from());
  if (!dir.ok()) return dir.status();
  for (int layer = 0; layer < NumLayers(job); ++layer) {
    absl::StatusOr<v1::LayerCheckpoint> checkpoint = dir->ReadLayer(job, layer);
    if (!checkpoint.ok()) return checkpoint.status();
    result.parameters += static_cast<int64_t>(checkpoint->payload().size() / sizeof(float));
    if (absl::Status saved = store.Save(*checkpoint); !saved.ok()) return saved;
    ++result.layers;
  }
  return result;
}

}  // namespace geotrain
