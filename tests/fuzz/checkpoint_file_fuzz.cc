// The checkpoint file reader and the coordinator's check of an uploaded
// checkpoint against the model. The first byte picks the mode: the input
// as a whole file (magic, CRC, length, body), or as a body that gets a
// correct frame (so that the fuzzer reaches the proto and the checks past
// the CRC).
#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/fuzz/fuzz_input.h"

#include "common/job_spec.h"
#include "coordinator/checkpoint_store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const geotrain::v1::JobSpec* job = new geotrain::v1::JobSpec(*geotrain::ParseJobSpec(
      "mlp { hidden: 4 hidden: 3 } fashion_mnist {} steps: 100", "fuzz"));
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);
  std::string file = rest;
  if (data[0] & 1) {
    geotrain::v1::LayerCheckpoint body;
    if (!body.ParseFromString(rest)) return 0;
    file = geotrain::FormatCheckpointFile(body);
  }
  absl::StatusOr<geotrain::v1::LayerCheckpoint> parsed = geotrain::ParseCheckpointFile(file);
  if (parsed.ok()) (void)geotrain::CheckLayerCheckpoint(*job, *parsed);
  return 0;
}
