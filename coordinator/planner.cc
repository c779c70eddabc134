#include "coordinator/planner.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace geotrain {

absl::StatusOr<std::vector<StageRange>> PlanStages(
    const std::vector<LayerProfile>& layers,
    const std::vector<PlannerWorker>& workers, int max_stages) {
  const int num_layers = static_cast<int>(layers.size());
  if (num_layers == 0) return absl::InvalidArgumentError("model has no layers");
  if (workers.empty()) return absl::FailedPreconditionError("no workers");
  int stages = std::min<int>(workers.size(), num_layers);
  if (max_stages > 0) stages = std::min(stages, max_stages);

  // The `stages` fastest workers, kept in join order.
  std::vector<int> order(workers.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return workers[a].gflops > workers[b].gflops;
  });
  order.resize(stages);
  std::sort(order.begin(), order.end());

  std::vector<double> flops_prefix(num_layers + 1, 0);
  std::vector<uint64_t> bytes_prefix(num_layers + 1, 0);
  for (int i = 0; i < num_layers; ++i) {
    flops_prefix[i + 1] = flops_prefix[i] + layers[i].flops_per_sample;
    bytes_prefix[i + 1] = bytes_prefix[i] + layers[i].training_bytes;
  }
  auto stage_time = [&](int k, int begin, int end) {
    const double gflops = std::max(workers[order[k]].gflops, 1e-3);
    return (flops_prefix[end] - flops_prefix[begin]) / (gflops * 1e9);
  };
  auto fits = [&](int k, int begin, int end) {
    const uint64_t memory = workers[order[k]].memory_bytes;
    return memory == 0 || bytes_prefix[end] - bytes_prefix[begin] <= memory;
  };

  // best[k][j]: smallest max stage time placing layers [0, j) on stages
  // [0, k]; cut[k][j]: where stage k begins in that solution.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages,
                                        std::vector<double>(num_layers + 1, kInf));
  std::vector<std::vector<int>> cut(stages, std::vector<int>(num_layers + 1, -1));
  for (int j = 1; j <= num_layers; ++j) {
    if (fits(0, 0, j)) best[0][j] = stage_time(0, 0, j);
  }
  for (int k = 1; k < stages; ++k) {
    for (int j = k + 1; j <= num_layers; ++j) {
      for (int i = k; i < j; ++i) {
        if (best[k - 1][i] == kInf || !fits(k, i, j)) continue;
        const double t = std::max(best[k - 1][i], stage_time(k, i, j));
        if (t < best[k][j]) {
          best[k][j] = t;
          cut[k][j] = i;
        }
      }
    }
  }
  if (best[stages - 1][num_layers] == kInf) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the model's ", num_layers, " layers (",
        bytes_prefix[num_layers] >> 20, " MiB to train) do not fit on ",
        stages, " workers' memory"));
  }
  std::vector<StageRange> plan(stages);
  int end = num_layers;
  for (int k = stages - 1; k >= 0; --k) {
    const int begin = k == 0 ? 0 : cut[k][end];
    plan[k].layer_begin = begin;
    plan[k].layer_end = end;
    plan[k].worker_id = workers[order[k]].id;
    plan[k].estimated_s = stage_time(k, begin, end);
    end = begin;
  }
  return plan;
}

}  // namespace geotrain
