// How many compute threads a worker should use so that the workers on one
// host share its CPUs instead of oversubscribing them (each LibTorch process
// otherwise starts one thread per core). Torch-free; thread-safe.
#ifndef GEOTRAIN_WORKER_THREAD_SHARE_H_
#define GEOTRAIN_WORKER_THREAD_SHARE_H_

#include <string>

namespace geotrain {

struct ThreadShare {
  int threads = 1;
  std::string reason;  // e.g. "fair share: 2 CPUs / 3 workers on this host"
};

// CPUs this process may run on: its affinity mask, capped by a cgroup v2
// CPU quota (cpu.max) when one is set. At least 1.
int UsableCpuCount();

// Live processes on this host (in this PID namespace) named
// geotrain-worker, this one included. At least 1.
int WorkersOnHost();

// `requested` > 0 is taken as it is; 0 gives each of `workers` an equal
// share of `cpus` (at least 1 thread). Pure.
ThreadShare ChooseThreads(int requested, int cpus, int workers);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_THREAD_SHARE_H_
