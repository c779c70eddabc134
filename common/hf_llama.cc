#include "common/hf_llama.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace geotrain {
namespace {

absl::Status Bad(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// A JSON number that is a whole int32 >= 0.
bool AsInt(const google::protobuf::Value& value, int* out) {
  uint64_t whole = 0;
  if (!WholeNumber(value, 2147483647, &whole)) return false;
  *out = static_cast<int>(whole);
  return true;
}

}  // namespace

std::string HfParameterName(const v1::LlamaModel& model, int layer, std::string_view local) {
  const std::string name(local);
  if (layer == 0) return "model." + name;
  if (layer == model.blocks() + 1) return name == "lm_head.weight" ? name : "model." + name;
  return absl::StrCat("model.layers.", layer - 1, ".", name);
}

std::string ExportedParameterName(const v1::JobSpec& job, int layer, std::string_view local) {
  if (job.has_llama()) return HfParameterName(job.llama(), layer, local);
  return absl::StrCat("layers.", layer, ".", absl::string_view(local.data(), local.size()));
}

std::string LlamaConfigJson(const v1::LlamaModel& m) {
  return absl::StrFormat(
      "{\n"
      "  \"architectures\": [\"LlamaForCausalLM\"],\n"
      "  \"model_type\": \"llama\",\n"
      "  \"hidden_size\": %d,\n"
      "  \"intermediate_size\": %d,\n"
      "  \"num_attention_heads\": %d,\n"
      "  \"num_key_value_heads\": %d,\n"
      "  \"num_hidden_layers\": %d,\n"
      "  \"vocab_size\": %d,\n"
      "  \"max_position_embeddings\": %d,\n"
      "  \"rope_theta\": %.17g,\n"
      "  \"rms_norm_eps\": %.17g,\n"
      "  \"tie_word_embeddings\": %s,\n"
      "  \"hidden_act\": \"silu\",\n"
      "  \"attention_bias\": false,\n"
      "  \"mlp_bias\": false,\n"
      "  \"torch_dtype\": \"float32\"\n"
      "}\n",
      m.d_model(), m.intermediate(), m.heads(), m.kv_heads(), m.blocks(), m.vocab(), m.context(),
      m.rope_theta(), m.rms_norm_eps(), m.tie_embeddings() ? "true" : "false");
}

absl::StatusOr<v1::LlamaModel> LlamaFromConfigJson(std::string_view json,
                                                   const std::string& path) {
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(std::string(json), &root).ok()) {
    return Bad(path, "not a JSON object");
  }
  const auto& f = root.fields();
  auto string_of = [&](const char* key) -> std::string {
    auto it = f.find(key);
    return it != f.end() && it->second.kind_case() == google::protobuf::Value::kStringValue
               ? it->second.string_value()
               : "";
  };
  if (string_of("model_type") != "llama") {
    return Bad(path, absl::StrCat("model_type is \"", string_of("model_type").substr(0, 64),
                                  "\", not \"llama\""));
  }
  v1::LlamaModel m;
  struct IntField {
    const char* key;
    void (v1::LlamaModel::*set)(int32_t);
    bool required;
  };
  for (const IntField& field : {
           IntField{"hidden_size", &v1::LlamaModel::set_d_model, true},
           IntField{"intermediate_size", &v1::LlamaModel::set_intermediate, true},
           IntField{"num_attention_heads", &v1::LlamaModel::set_heads, true},
           IntField{"num_key_value_heads", &v1::LlamaModel::set_kv_heads, false},
           IntField{"num_hidden_layers", &v1::LlamaModel::set_blocks, true},
           IntField{"vocab_size", &v1::LlamaModel::set_vocab, true},
           IntField{"max_position_embeddings", &v1::LlamaModel::set_context, true}}) {
    auto it = f.find(field.key);
    int value = 0;
    if (it == f.end()) {
      if (field.required) return Bad(path, absl::StrCat("lacks ", field.key));
      continue;
    }
    if (!AsInt(it->second, &value) || value == 0) {
      return Bad(path, absl::StrCat(field.key, " is not a positive whole number"));
    }
    (m.*field.set)(value);
  }
  if (m.kv_heads() == 0) m.set_kv_heads(m.heads());
  auto number_of = [&](const char* key, double fallback, double* out) {
    auto it = f.find(key);
    if (it == f.end() || it->second.kind_case() == google::protobuf::Value::kNullValue) {
      *out = fallback;
      return true;
    }
    if (it->second.kind_case() != google::protobuf::Value::kNumberValue) return false;
    *out = it->second.number_value();
    return true;
  };
  double theta, eps;
  if (!number_of("rope_theta", 10000, &theta) || !number_of("rms_norm_eps", 1e-6, &eps)) {
    return Bad(path, "rope_theta or rms_norm_eps is not a number");
  }
  m.set_rope_theta(theta);
  m.set_rms_norm_eps(eps);
  auto flag = [&](const char* key) {
    auto it = f.find(key);
    return it != f.end() && it->second.kind_case() == google::protobuf::Value::kBoolValue &&
           it->second.bool_value();
  };
  m.set_tie_embeddings(flag("tie_word_embeddings"));
  if (flag("attention_bias") || flag("mlp_bias")) {
    return Bad(path, "attention_bias or mlp_bias is set: geotrain's LLaMA has no biases");
  }
  if (auto it = f.find("rope_scaling");
      it != f.end() && it->second.kind_case() != google::protobuf::Value::kNullValue) {
    return Bad(path, "rope_scaling is set: geotrain implements plain rotary positions only");
  }
  if (string_of("hidden_act") != "" && string_of("hidden_act") != "silu") {
    return Bad(path, absl::StrCat("hidden_act is \"", string_of("hidden_act").substr(0, 64),
                                  "\", not \"silu\""));
  }
  if (auto it = f.find("head_dim");
      it != f.end() && it->second.kind_case() != google::protobuf::Value::kNullValue) {
    int head_dim = 0;
    if (!AsInt(it->second, &head_dim) || head_dim * m.heads() != m.d_model()) {
      return Bad(path, "head_dim is not hidden_size / num_attention_heads");
    }
  }
  return m;
}

absl::Status CheckLlamaAgainstConfig(const v1::LlamaModel& job_block,
                                     const v1::LlamaModel& config,
                                     const std::string& config_path) {
  struct Field {
    const char* job_name;
    const char* config_name;
    double job, config;
  };
  // The context is the training window: any length the positions cover.
  if (job_block.context() > config.context()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the job's llama.context is %d but %s has max_position_embeddings %d", job_block.context(),
        config_path, config.context()));
  }
  for (const Field& field : {
           Field{"d_model", "hidden_size", double(job_block.d_model()), double(config.d_model())},
           Field{"heads", "num_attention_heads", double(job_block.heads()),
                 double(config.heads())},
           Field{"kv_heads", "num_key_value_heads", double(job_block.kv_heads()),
                 double(config.kv_heads())},
           Field{"blocks", "num_hidden_layers", double(job_block.blocks()),
                 double(config.blocks())},
           Field{"intermediate", "intermediate_size", double(job_block.intermediate()),
                 double(config.intermediate())},
           Field{"vocab", "vocab_size", double(job_block.vocab()), double(config.vocab())},
           Field{"rope_theta", "rope_theta", job_block.rope_theta(), config.rope_theta()},
           Field{"rms_norm_eps", "rms_norm_eps", job_block.rms_norm_eps(),
                 config.rms_norm_eps()}}) {
    if (field.job != 0 && field.job != field.config) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the job's llama.%s is %g but %s has %s %g", field.job_name, field.job, config_path,
          field.config_name, field.config));
    }
  }
  if (job_block.tie_embeddings() && !config.tie_embeddings()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the job's llama.tie_embeddings is true but ", config_path,
        " has tie_word_embeddings false"));
  }
  return absl::OkStatus();
}

}  // namespace geotrain
