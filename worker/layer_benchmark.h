// Pre-flight compute measurement: forward + backward of one layer of each
// kind of the job's model, on the worker's device, with the job's
// microbatch shape, so that the planner does not rely on a matmul benchmark
// and a FLOPs model. LibTorch stays in the .cc.
#ifndef GEOTRAIN_WORKER_LAYER_BENCHMARK_H_
#define GEOTRAIN_WORKER_LAYER_BENCHMARK_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

// Seconds per sample by layer kind: the median of at least 3 timed
// iterations after a warm-up, each kind given about `budget` / kinds (a kind
// slower than that gets 1 warm-up and 1 timed run). Errors from LibTorch
// (an unknown device, out of memory) come back as a Status.
absl::StatusOr<std::map<std::string, double>> TimeLayerKinds(const v1::JobSpec& job,
                                                             const std::string& device,
                                                             absl::Duration budget);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LAYER_BENCHMARK_H_
