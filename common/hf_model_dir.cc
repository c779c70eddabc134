#include "common/hf_model_dir.h"

#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/hf_llama.h"
#include "common/model_profile.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace geotrain {
namespace {

// float32 from the top half of its bits (bf16) or from IEEE half (fp16).
float FromBf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

float FromFp16(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

}  // namespace

absl::StatusOr<HfModelDir> HfModelDir::Open(const std::string& dir) {
  HfModelDir model;
  model.dir_ = dir;
  std::vector<std::string> names;
  const std::string index_path = dir + "/model.safetensors.index.json";
  absl::StatusOr<std::string> index = ReadFileBounded(index_path, 64 << 20);
  if (index.ok()) {
    google::protobuf::Struct root;
    if (!google::protobuf::util::JsonStringToMessage(*index, &root).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a JSON object"));
    }
    auto map = root.fields().find("weight_map");
    if (map == root.fields().end() ||
        map->second.kind_case() != google::protobuf::Value::kStructValue) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": no \"weight_map\" object"));
    }
    std::set<std::string> files;
    for (const auto& [tensor, file] : map->second.struct_value().fields()) {
      const std::string& name = file.string_value();
      if (file.kind_case() != google::protobuf::Value::kStringValue || name.empty() ||
          name.find('/') != std::string::npos || name == "." || name == "..") {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": tensor \"", tensor.substr(0, 128), "\" maps to a file name that is "
            "not a plain name in the directory"));
      }
      files.insert(name);
    }
    names.assign(files.begin(), files.end());
  } else if (index.status().code() == absl::StatusCode::kNotFound) {
    names.push_back("model.safetensors");
  } else {
    return index.status();
  }
  for (const std::string& name : names) {
    absl::StatusOr<SafetensorsReader> file = SafetensorsReader::Open(dir + "/" + name);
    if (!file.ok()) return file.status();
    model.files_.push_back(std::make_unique<SafetensorsReader>(*std::move(file)));
    for (const SafetensorsTensor& t : model.files_.back()->header().tensors) {
      model.where_[t.name] = model.files_.back().get();
    }
  }
  return model;
}

absl::StatusOr<v1::LayerCheckpoint> HfModelDir::ReadLayer(const v1::JobSpec& job,
                                                          int layer) const {
  v1::LayerCheckpoint checkpoint;
  checkpoint.set_layer(layer);
  checkpoint.set_step(0);
  std::string* payload = checkpoint.mutable_payload();
  for (const ParameterSpec& spec : LayerParameters(job, layer)) {
    std::string name = ExportedParameterName(job, layer, spec.name);
    auto where = where_.find(name);
    // A tied head is saved as the embedding alone (tie_word_embeddings).
    if (where == where_.end() && job.has_llama() && job.llama().tie_embeddings() &&
        name == "lm_head.weight") {
      name = ExportedParameterName(job, 0, "embed_tokens.weight");
      where = where_.find(name);
    }
    if (where == where_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir_, " has no tensor \"", name, "\", which the job's model needs"));
    }
    const SafetensorsReader& file = *where->second;
    const SafetensorsTensor& t = *file.Find(name);
    if (t.shape != spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": \"", name, "\" has shape [", absl::StrJoin(t.shape, ","),
          "]; the job's model needs [", absl::StrJoin(spec.shape, ","), "]"));
    }
    const std::string_view data = file.Data(t);
    const size_t before = payload->size();
    if (t.dtype == "F32") {
      payload->append(data.data(), data.size());
    } else if (t.dtype == "BF16" || t.dtype == "F16") {
      payload->resize(before + data.size() * 2);
      for (size_t i = 0; i < data.size() / 2; ++i) {
        uint16_t bits;
        std::memcpy(&bits, data.data() + 2 * i, 2);
        const float value = t.dtype == "BF16" ? FromBf16(bits) : FromFp16(bits);
        std::memcpy(payload->data() + before + 4 * i, &value, 4);
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(file.path(), ": \"", name, "\" is ",
                                                     t.dtype, "; F32, BF16 or F16 is needed"));
    }
    v1::TensorHeader* header = checkpoint.add_params();
    for (int64_t dim : spec.shape) header->add_shape(dim);
    header->set_dtype(v1::DTYPE_FLOAT32);
    header->set_codec(v1::CODEC_NONE);
    header->set_payload_bytes(payload->size() - before);
  }
  return checkpoint;
}

}  // namespace geotrain
