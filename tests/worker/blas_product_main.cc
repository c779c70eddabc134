// Helper of blas_kernel_test: computes fixed fp32 matrix products with
// LibTorch (whatever BLAS and core this process loaded: the test sets
// OPENBLAS_CORETYPE), writes the results to argv[1] as raw floats and prints
// the OpenBLAS core it ran on.
#include <torch/torch.h>

#include <cstdio>
#include <fstream>

#include "worker/compute_environment.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: blas_product OUT_FILE\n");
    return 2;
  }
  torch::manual_seed(7);
  std::ofstream out(argv[1], std::ios::binary);
  // Shapes of the demo GPT's products (16x64 tokens by d_model 128, its
  // 4x MLP) and a square one, with odd sizes that hit the kernels' edges.
  for (const auto& [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{1024, 128, 512},
                                {1024, 512, 128}, {512, 512, 512}, {77, 131, 65}}) {
    const torch::Tensor a = torch::randn({m, k});
    const torch::Tensor b = torch::randn({k, n});
    const torch::Tensor c = torch::matmul(a, b).contiguous();
    out.write(static_cast<const char*>(c.data_ptr()), c.numel() * sizeof(float));
  }
  const auto openblas = geotrain::LoadedOpenBlas();
  std::printf("%s\n", openblas.has_value() ? openblas->core.c_str() : "not-openblas");
  return out.good() ? 0 : 1;
}
