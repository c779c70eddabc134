// Pre-flight compute measurement: forward + backward of one layer of each
// kind of the job's model, on the worker's device, with the job's
// microbatch shape, so that the planner does not rely on a matmul benchmark
// and a FLOPs model. LibTorch stays in the .cc.
#ifndef GEOTRAIN_WORKER_LAYER_BENCHMARK_H_
#define GEOTRAIN_WORKER_LAYER_BENCHMARK_H_

#include <functional>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

// The time `once` takes. With `cpu_time`: CPU time, never more than the
// wall time; with one compute thread (`threads` == 1, LibTorch computing
// on the calling thread, as torch::set_num_threads(1) makes it) the calling
// thread's, otherwise the process's per thread. Without: the wall time.
// Exposed for tests.
double ComputeSeconds(const std::function<void()>& once, bool cpu_time, int threads);

// Seconds per sample by layer kind: the median of at least 3 timed
// iterations after a warm-up, each kind given about `budget` / kinds (a kind
// slower than that gets 1 warm-up and 1 timed run). Errors from LibTorch
// (an unknown device, out of memory) come back as a Status.
//
// On a CPU device an iteration's time is the CPU time its compute threads
// spent (ComputeSeconds), not the wall time: workers that share a host join
// at about the same time, and whichever benchmarked while another did got
// fewer time slices (equal workers' figures differed by up to 1.8x, and the
// planner cut 2+4 where 3+3 was right). Load that lasts shows in the stages'
// measured times, which the coordinator calibrates with
// (CalibrateWithStageStats). On a GPU: wall time, synchronized.
absl::StatusOr<std::map<std::string, double>> TimeLayerKinds(const v1::JobSpec& job,
                                                             const std::string& device,
                                                             absl::Duration budget);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LAYER_BENCHMARK_H_
