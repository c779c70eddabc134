// What the planner and the link validators need to know about a job's model
// without building it: its partitioning units ("layers"), their cost, and the
// shapes of the tensors that cross each boundary between layers.
#ifndef GEOTRAIN_COMMON_MODEL_PROFILE_H_
#define GEOTRAIN_COMMON_MODEL_PROFILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "geotrain/v1/job.pb.h"
#include "geotrain/v1/tensor.pb.h"

namespace geotrain {

struct LayerProfile {
  // What a worker benchmarks per layer kind: "embed", "block", "head"
  // (GPT, LLaMA), "linear" (MLP).
  std::string kind;
  double flops_per_sample = 0;  // forward + backward
  uint64_t parameter_count = 0;
  // Bytes a stage holds for this layer while training: parameters, their
  // gradients and optimizer state, plus activations of in-flight microbatches.
  uint64_t training_bytes = 0;
};

struct TensorSpec {
  std::vector<int64_t> shape;  // dimension 0 is the microbatch size
  v1::DType dtype = v1::DTYPE_FLOAT32;
};

// A model over token sequences (gpt or llama): the figures they share.
bool IsLanguageModel(const v1::JobSpec& job);
int ContextOf(const v1::JobSpec& job);   // tokens per sample; 0 for the MLP
int DModelOf(const v1::JobSpec& job);    // width of the activations; 0 for the MLP
int64_t VocabOf(const v1::JobSpec& job); // token ids are in [0, VocabOf); 0 for the MLP

int NumLayers(const v1::JobSpec& job);
std::vector<LayerProfile> ProfileLayers(const v1::JobSpec& job);

// One parameter of a layer, as the layer names it (Hugging Face's local
// names for LLaMA: "self_attn.q_proj.weight"), float32.
struct ParameterSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Layer `layer`'s parameters in the order the worker's layer holds them
// (the order of a checkpoint's tensors), without building it.
std::vector<ParameterSpec> LayerParameters(const v1::JobSpec& job, int layer);

// The tensor entering layer `layer` (0 <= layer < NumLayers) for a microbatch
// of `batch` samples. Layer 0's input is the data itself.
TensorSpec LayerInputSpec(const v1::JobSpec& job, int layer, int64_t batch);
// Targets are class indices in [0, NumTargetClasses(job)).
int64_t NumTargetClasses(const v1::JobSpec& job);

// The targets that travel with each activation.
TensorSpec TargetSpec(const v1::JobSpec& job, int64_t batch);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_MODEL_PROFILE_H_
