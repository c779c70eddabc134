// The job-spec parser and everything the coordinator derives from a valid
// spec before it plans (layer profiles, boundary shapes).
#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/fuzz/fuzz_input.h"

#include "common/job_spec.h"
#include "common/model_profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (64 << 10)) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<geotrain::v1::JobSpec> job = geotrain::ParseJobSpec(text, "fuzz");
  if (!job.ok()) return 0;
  const int layers = geotrain::NumLayers(*job);
  (void)geotrain::ProfileLayers(*job);
  for (int layer = 0; layer < layers; ++layer) {
    (void)geotrain::LayerInputSpec(*job, layer, job->microbatch_size());
  }
  (void)geotrain::TargetSpec(*job, job->microbatch_size());
  return 0;
}
