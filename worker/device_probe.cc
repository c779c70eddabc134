#include "worker/device_probe.h"

#include <torch/torch.h>

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/process_stats.h"

namespace geotrain {

absl::StatusOr<v1::DeviceInfo> ProbeDevice(const std::string& requested, int threads) {
  if (threads > 0) {
    torch::set_num_threads(threads);
  }
  std::string name = requested;
  if (name == "auto") name = torch::cuda::is_available() ? "cuda:0" : "cpu";
  if (name != "cpu" && !absl::StartsWith(name, "cuda")) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown --device=", requested, " (auto, cpu, cuda or cuda:N)"));
  }
  if (absl::StartsWith(name, "cuda") && !torch::cuda::is_available()) {
    return absl::UnavailableError(absl::StrCat(
        "--device=", requested,
        " but CUDA is not available (no GPU visible, or this LibTorch is CPU-only)"));
  }
  try {
    const torch::Device device(name);
    constexpr int64_t n = 512;
    torch::Tensor a = torch::randn({n, n}, torch::TensorOptions().device(device));
    torch::Tensor b = torch::randn({n, n}, torch::TensorOptions().device(device));
    torch::matmul(a, b);  // warm-up
    if (device.is_cuda()) torch::cuda::synchronize();
    int iterations = 0;
    const auto start = std::chrono::steady_clock::now();
    double elapsed = 0;
    while (elapsed < 0.25) {
      torch::Tensor c = torch::matmul(a, b);
      if (device.is_cuda()) torch::cuda::synchronize();
      ++iterations;
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                    .count();
    }
    v1::DeviceInfo info;
    info.set_device(device.str());
    info.set_matmul_gflops(2.0 * n * n * n * iterations / elapsed / 1e9);
    // GPU memory needs the CUDA runtime; host memory is the bound used here.
    info.set_memory_bytes(AvailableMemoryBytes());
    info.set_threads(torch::get_num_threads());
    return info;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("benchmarking ", name, ": ", e.what_without_backtrace()));
  }
}

}  // namespace geotrain
