// Measures what a worker brings to the job: the device it computes on, its
// matmul throughput and the memory a stage may use. Torch-free header.
#ifndef GEOTRAIN_WORKER_DEVICE_PROBE_H_
#define GEOTRAIN_WORKER_DEVICE_PROBE_H_

#include <string>

#include "absl/status/statusor.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

// Resolves `requested` ("auto", "cpu", "cuda", "cuda:N"; auto prefers a GPU),
// sets LibTorch's thread count to `threads` (0: leave LibTorch's default),
// and benchmarks a fp32 matmul on the device. INVALID_ARGUMENT for an
// unknown device name, UNAVAILABLE for CUDA without a usable GPU.
absl::StatusOr<v1::DeviceInfo> ProbeDevice(const std::string& requested, int threads);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_DEVICE_PROBE_H_
