#include "worker/device_probe.h"

#include <dlfcn.h>
#include <unistd.h>
#include <torch/torch.h>

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/process_stats.h"
#include "worker/compute_environment.h"

namespace geotrain {
namespace {

// The value after "KEY=" or "KEY: " in LibTorch's build summary (up to the
// next comma or line end), or "".
std::string ConfigValue(const std::string& config, const std::string& key) {
  for (const char* separator : {"=", ": "}) {
    const std::string needle = key + separator;
    const size_t at = config.find(needle);
    if (at == std::string::npos) continue;
    const size_t begin = at + needle.size();
    const size_t end = config.find_first_of(",\n", begin);
    return std::string(absl::StripAsciiWhitespace(config.substr(begin, end - begin)));
  }
  return "";
}

// Free and total memory of CUDA device `index`, from the CUDA runtime that
// LibTorch loaded (looked up, so CPU-only builds need no CUDA at all).
bool CudaMemory(int index, uint64_t* free_bytes, uint64_t* total_bytes) {
  using SetDevice = int (*)(int);
  using MemGetInfo = int (*)(size_t*, size_t*);
  auto set_device = reinterpret_cast<SetDevice>(dlsym(RTLD_DEFAULT, "cudaSetDevice"));
  auto mem_get_info = reinterpret_cast<MemGetInfo>(dlsym(RTLD_DEFAULT, "cudaMemGetInfo"));
  if (set_device == nullptr || mem_get_info == nullptr) return false;
  size_t free = 0, total = 0;
  if (set_device(index) != 0 || mem_get_info(&free, &total) != 0) return false;
  *free_bytes = free;
  *total_bytes = total;
  return true;
}

uint64_t TotalHostMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * page : 0;
}

}  // namespace

std::string DescribeBlas() {
  if (const std::optional<OpenBlasInfo> openblas = LoadedOpenBlas(); openblas.has_value()) {
    // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY USE_OPENMP Zen MAX_THREADS=64"
    std::vector<std::string> words = absl::StrSplit(openblas->config, ' ', absl::SkipEmpty());
    std::vector<std::string> flags;
    for (size_t i = 2; i < words.size(); ++i) {
      if (words[i] == openblas->core || absl::StartsWith(words[i], "MAX_") ||
          absl::StartsWith(words[i], "NO_")) {
        continue;
      }
      flags.push_back(words[i]);
    }
    return absl::StrCat(words.size() >= 2 ? absl::StrCat(words[0], " ", words[1]) : "OpenBLAS",
                        flags.empty() ? "" : absl::StrCat(" (", absl::StrJoin(flags, " "), ")"),
                        ", core ", openblas->core);
  }
  try {
    const std::string config = at::show_config();
    std::string blas = ConfigValue(config, "BLAS_INFO");
    if (blas.empty()) blas = "unknown BLAS";
    const std::string isa = ConfigValue(config, "CPU capability usage");
    return isa.empty() ? blas : absl::StrCat(blas, ", CPU capability ", isa);
  } catch (const c10::Error& e) {
    return "unknown BLAS";
  }
}

ThreadShare ApplyComputeThreads(int requested) {
  const ThreadShare share = ChooseThreads(requested, UsableCpuCount(), WorkersOnHost());
  if (torch::get_num_threads() != share.threads) torch::set_num_threads(share.threads);
  return share;
}

absl::StatusOr<v1::DeviceInfo> ProbeDevice(const std::string& requested, int threads) {
  const ThreadShare share = ApplyComputeThreads(threads);
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
    torch::Device device(name);
    if (device.is_cuda() && !device.has_index()) device = torch::Device(torch::kCUDA, 0);
    if (device.is_cuda() && device.index() >= static_cast<int>(torch::cuda::device_count())) {
      return absl::InvalidArgumentError(absl::StrCat("--device=", requested, ": only ",
                                                     torch::cuda::device_count(),
                                                     " CUDA device(s) visible"));
    }
    // Waits for `device` itself: synchronising the default device would time
    // only the kernel launches on cuda:N.
    auto wait = [&] {
      if (device.is_cuda()) torch::cuda::synchronize(device.index());
    };
    constexpr int64_t n = 512;
    torch::Tensor a = torch::randn({n, n}, torch::TensorOptions().device(device));
    torch::Tensor b = torch::randn({n, n}, torch::TensorOptions().device(device));
    torch::matmul(a, b);  // warm-up
    wait();
    int iterations = 0;
    const auto start = std::chrono::steady_clock::now();
    double elapsed = 0;
    while (elapsed < 0.25) {
      torch::Tensor c = torch::matmul(a, b);
      wait();
      ++iterations;
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                    .count();
    }
    v1::DeviceInfo info;
    info.set_device(device.str());
    info.set_matmul_gflops(2.0 * n * n * n * iterations / elapsed / 1e9);
    uint64_t free_bytes = AvailableMemoryBytes(), total_bytes = TotalHostMemoryBytes();
    if (device.is_cuda() && !CudaMemory(device.index(), &free_bytes, &total_bytes)) {
      return absl::InternalError(absl::StrCat("cannot read the memory of ", device.str(),
                                              " from the CUDA runtime"));
    }
    info.set_memory_bytes(free_bytes);
    info.set_memory_total_bytes(total_bytes);
    info.set_threads(torch::get_num_threads());
    info.set_threads_reason(share.reason);
    info.set_blas(DescribeBlas());
    info.set_environment(ComputeEnvironmentNote());
    return info;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("benchmarking ", name, ": ", e.what_without_backtrace()));
  }
}

}  // namespace geotrain
