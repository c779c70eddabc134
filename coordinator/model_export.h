// Writes the newest complete model in the coordinator's checkpoint store
// (the newest step at which every layer has a checkpoint) as a directory
// another tool can load: Hugging Face safetensors (sharded past
// max_shard_bytes, with model.safetensors.index.json) and config.json.
// A LLaMA gets LlamaForCausalLM's names and config; the GPT and the MLP get
// "layers.<i>.<name>" and a config.json holding the job's model block.
// Torch-free; streams one layer's checkpoint at a time, so memory stays
// about one layer. Thread-compatible (the store is thread-safe).
#ifndef GEOTRAIN_COORDINATOR_MODEL_EXPORT_H_
#define GEOTRAIN_COORDINATOR_MODEL_EXPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/checkpoint_store.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

struct ModelExportOptions {
  std::string out_dir;                        // created if missing
  uint64_t max_shard_bytes = uint64_t{2} << 30;  // per safetensors file
};

struct ModelExport {
  int step = 0;                     // the checkpoints' step
  std::vector<std::string> files;   // written, in out_dir
  uint64_t tensor_bytes = 0;
  int64_t parameters = 0;
};

// FAILED_PRECONDITION when no step has a checkpoint of every layer;
// DATA_LOSS when a checkpoint does not hold the parameters the model's
// layer does; UNAVAILABLE when a file cannot be written (nothing is left
// half-written under its final name).
absl::StatusOr<ModelExport> ExportModel(const v1::JobSpec& job, CheckpointStore& store,
                                        const ModelExportOptions& options);

struct ModelImport {
  int layers = 0;  // imported as step 0; 0 when the store already had checkpoints
  int64_t parameters = 0;
};

// Starts a job from `job.init_from` (a Hugging Face directory, read by
// HfModelDir): every layer goes into `store` as its checkpoint of step 0,
// one layer in memory at a time, so the workers restore them as they
// restore any checkpoint. Does nothing when the store holds a checkpoint
// already (a restarted coordinator resumes the job instead). Errors as
// HfModelDir's, naming the directory and the tensor.
absl::StatusOr<ModelImport> ImportModel(const v1::JobSpec& job, CheckpointStore& store);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_MODEL_EXPORT_H_
