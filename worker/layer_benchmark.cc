#include "worker/layer_benchmark.h"

#include <torch/torch.h>

#include <time.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_profile.h"
#include "worker/models.h"

namespace geotrain {
namespace {

torch::Dtype TorchType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_INT64:
      return torch::kInt64;
    default:
      return torch::kFloat32;
  }
}

// A random input of the layer's shape: token ids in range for integer
// inputs, floats that need a gradient otherwise.
torch::Tensor InputFor(const v1::JobSpec& job, int layer, int64_t batch,
                       const torch::Device& device) {
  const TensorSpec spec = LayerInputSpec(job, layer, batch);
  std::vector<int64_t> shape(spec.shape.begin(), spec.shape.end());
  const torch::Dtype type = TorchType(spec.dtype);
  if (type == torch::kFloat32) {
    return torch::randn(shape, torch::TensorOptions().device(device)).requires_grad_(true);
  }
  return torch::randint(0, 256, shape, torch::TensorOptions().dtype(type).device(device));
}

double ClockSeconds(clockid_t clock) {
  timespec now{};
  clock_gettime(clock, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

}  // namespace

double ComputeSeconds(const std::function<void()>& once, bool cpu_time, int threads) {
  const clockid_t clock = threads <= 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_PROCESS_CPUTIME_ID;
  const absl::Time wall_start = absl::Now();
  const double cpu_start = ClockSeconds(clock);
  once();
  const double cpu = ClockSeconds(clock) - cpu_start;
  const double wall = absl::ToDoubleSeconds(absl::Now() - wall_start);
  if (!cpu_time) return wall;
  // The process's CPU time also holds its other threads' work (link probes
  // answered meanwhile): never more than the wall time.
  return std::min(wall, cpu / std::max(1, threads));
}

absl::StatusOr<std::map<std::string, double>> TimeLayerKinds(const v1::JobSpec& job,
                                                             const std::string& device_name,
                                                             absl::Duration budget) {
  const std::vector<LayerProfile> layers = ProfileLayers(job);
  std::map<std::string, int> first_of_kind;
  for (size_t l = 0; l < layers.size(); ++l) first_of_kind.emplace(layers[l].kind, l);
  if (first_of_kind.empty()) return absl::InvalidArgumentError("the model has no layers");
  const absl::Duration per_kind = budget / static_cast<double>(first_of_kind.size());
  const int64_t batch = std::max(1, job.microbatch_size());
  std::map<std::string, double> seconds_per_sample;
  try {
    const torch::Device device(device_name);
    for (const auto& [kind, layer] : first_of_kind) {
      std::shared_ptr<Layer> module = BuildLayers(job, layer, layer + 1).at(0);
      module->to(device);
      const torch::Tensor input = InputFor(job, layer, batch, device);
      auto once = [&]() {
        torch::Tensor out = module->forward(input);
        out.to(torch::kFloat32).square().mean().backward();
        if (device.is_cuda()) torch::cuda::synchronize();
      };
      once();  // warm-up: allocations, kernels picked
      const bool cpu_time = !device.is_cuda();
      const int threads = torch::get_num_threads();
      std::vector<double> runs;
      const absl::Time start = absl::Now();
      while (true) {
        runs.push_back(ComputeSeconds(once, cpu_time, threads));
        const bool too_slow = runs.size() == 1 && runs[0] > absl::ToDoubleSeconds(per_kind);
        const bool enough = runs.size() >= 3 && absl::Now() - start >= per_kind;
        if (too_slow || enough || runs.size() >= 20) break;
      }
      std::sort(runs.begin(), runs.end());
      seconds_per_sample[kind] = runs[runs.size() / 2] / static_cast<double>(batch);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("timing the model's layers: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("timing the model's layers: ", e.what()));
  }
  return seconds_per_sample;
}

}  // namespace geotrain
