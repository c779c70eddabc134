// Measures what a worker brings to the job: the device it computes on, its
// matmul throughput, the BLAS behind LibTorch's CPU kernels, the threads it
// computes with and the memory a stage may use. Torch-free header.
#ifndef GEOTRAIN_WORKER_DEVICE_PROBE_H_
#define GEOTRAIN_WORKER_DEVICE_PROBE_H_

#include <string>

#include "absl/status/statusor.h"
#include "geotrain/v1/coordinator.pb.h"
#include "worker/thread_share.h"

namespace geotrain {

// Resolves `requested` ("auto", "cpu", "cuda", "cuda:N"; auto prefers a GPU),
// sets LibTorch's threads (ApplyComputeThreads(threads)), and benchmarks a
// fp32 matmul on the device, synchronising that device. Memory is the
// device's free/total from the CUDA runtime on a GPU, the host's otherwise.
// INVALID_ARGUMENT for an unknown device name, UNAVAILABLE for CUDA without
// a usable GPU.
absl::StatusOr<v1::DeviceInfo> ProbeDevice(const std::string& requested, int threads);

// Sets LibTorch's intra-op threads: `requested` > 0 as given, 0 a fair
// share of this host's CPUs among the geotrain workers running on it now.
// Call from the thread that runs the compute (OpenMP's thread count is per
// calling thread).
ThreadShare ApplyComputeThreads(int requested);

// The BLAS LibTorch's CPU matmuls go through, with its kernel core where the
// library says (OpenBLAS), e.g. "OpenBLAS 0.3.21 (DYNAMIC_ARCH USE_OPENMP),
// core Zen".
std::string DescribeBlas();

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_DEVICE_PROBE_H_
