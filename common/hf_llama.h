// Hugging Face's LlamaForCausalLM as seen from a job: its config.json and
// its parameter names. Torch-free (the coordinator and geotrain-ctl use
// it); thread-safe.
#ifndef GEOTRAIN_COMMON_HF_LLAMA_H_
#define GEOTRAIN_COMMON_HF_LLAMA_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

// The full name in LlamaForCausalLM of parameter `local` (as a geotrain
// layer names it) of layer `layer` (0: the embedding, 1..blocks: decoder
// blocks, blocks + 1: the head): "model.embed_tokens.weight",
// "model.layers.<i>.self_attn.q_proj.weight", "model.norm.weight",
// "lm_head.weight".
std::string HfParameterName(const v1::LlamaModel& model, int layer, std::string_view local);

// The name a geotrain export (and init_from) gives parameter `local` of
// layer `layer`: HfParameterName for a LLaMA, "layers.<layer>.<local>" for
// the other models.
std::string ExportedParameterName(const v1::JobSpec& job, int layer, std::string_view local);

// config.json for `model` (float32, architectures ["LlamaForCausalLM"]).
std::string LlamaConfigJson(const v1::LlamaModel& model);

// The architecture in a config.json (`path` names it in errors):
// INVALID_ARGUMENT when it is not JSON, not a LLaMA, or lacks a field
// geotrain needs, or uses one geotrain does not implement (rope_scaling,
// attention or MLP biases, a head_dim other than hidden_size / heads).
absl::StatusOr<v1::LlamaModel> LlamaFromConfigJson(std::string_view json,
                                                   const std::string& path);

// OK when every field the job's block sets (non-zero; the block as
// written, before ApplyJobDefaults) equals the config's (the context, a
// training window, may be shorter than max_position_embeddings); otherwise INVALID_ARGUMENT naming the field, both values and
// `config_path`. The block may be left empty: the config then decides.
absl::Status CheckLlamaAgainstConfig(const v1::LlamaModel& job_block,
                                     const v1::LlamaModel& config, const std::string& config_path);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_HF_LLAMA_H_
