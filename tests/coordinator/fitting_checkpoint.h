// A checkpoint of one layer that fits the model, for the coordinator's
// tests: the layer's parameters' shapes in order, each followed by
// `state_per_param` optimizer tensors, all zero.
#ifndef GEOTRAIN_TESTS_COORDINATOR_FITTING_CHECKPOINT_H_
#define GEOTRAIN_TESTS_COORDINATOR_FITTING_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/model_profile.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

inline v1::LayerCheckpoint FittingCheckpoint(const v1::JobSpec& job, const std::string& worker,
                                             int layer, int step, int state_per_param = 0) {
  v1::LayerCheckpoint c;
  c.set_worker_id(worker);
  c.set_layer(layer);
  c.set_step(step);
  c.set_state_per_param(state_per_param);
  uint64_t bytes = 0;
  auto fill = [&bytes](v1::TensorHeader* h, const std::vector<int64_t>& shape) {
    h->set_dtype(v1::DTYPE_FLOAT32);
    h->set_codec(v1::CODEC_NONE);
    uint64_t n = 1;
    for (int64_t dim : shape) {
      h->add_shape(dim);
      n *= static_cast<uint64_t>(dim);
    }
    h->set_payload_bytes(4 * n);
    h->set_encoded_bytes(4 * n);
    bytes += 4 * n;
  };
  const std::vector<ParameterSpec> params = LayerParameters(job, layer);
  for (const ParameterSpec& p : params) fill(c.add_params(), p.shape);
  for (const ParameterSpec& p : params) {
    for (int k = 0; k < state_per_param; ++k) fill(c.add_optimizer_state(), p.shape);
  }
  c.mutable_payload()->assign(bytes, '\0');
  return c;
}

}  // namespace geotrain

#endif  // GEOTRAIN_TESTS_COORDINATOR_FITTING_CHECKPOINT_H_
