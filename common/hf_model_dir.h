// A Hugging Face model directory read as geotrain layers (init_from):
// model.safetensors, or shards listed by model.safetensors.index.json
// ("weight_map": name -> file). Every file is mapped read-only and its
// header checked (common/safetensors.h); a layer is copied out one at a
// time. Torch-free: the coordinator imports with it, geotrain-eval loads
// with it. Thread-compatible.
#ifndef GEOTRAIN_COMMON_HF_MODEL_DIR_H_
#define GEOTRAIN_COMMON_HF_MODEL_DIR_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

class HfModelDir {
 public:
  // NOT_FOUND when `dir` has neither model.safetensors nor an index;
  // INVALID_ARGUMENT (naming the file) for a malformed index or file, or an
  // index that names a file outside `dir`.
  static absl::StatusOr<HfModelDir> Open(const std::string& dir);

  // Layer `layer` of `job` as a checkpoint of step 0 with parameters only
  // (state_per_param 0), float32, in the order the worker's layer holds
  // them, named as ExportedParameterName says. F16 and BF16 tensors are
  // widened. INVALID_ARGUMENT naming the tensor and the file when one is
  // missing, has another shape than the model's, or another dtype.
  absl::StatusOr<v1::LayerCheckpoint> ReadLayer(const v1::JobSpec& job, int layer) const;

  const std::string& dir() const { return dir_; }

 private:
  HfModelDir() = default;
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, const SafetensorsReader*> where_;  // tensor name -> its file
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_HF_MODEL_DIR_H_
