// The OpenBLAS core a worker chooses must compute the same products as the
// generic kernel it replaces, to float tolerance. Runs blas_product (same
// LibTorch, same inputs) under OPENBLAS_CORETYPE=Prescott and under the
// chosen core, and compares.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "worker/compute_environment.h"

namespace geotrain {
namespace {

struct ProductRun {
  std::string core;
  std::vector<float> values;
};

ProductRun Products(const std::string& core) {
  const std::string out = absl::StrCat(::testing::TempDir(), "/blas_product_", core, ".bin");
  const std::string command = absl::StrCat("OPENBLAS_CORETYPE=", core, " '", GEOTRAIN_BIN_DIR,
                                           "/blas_product' '", out, "'");
  ProductRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char line[128] = {0};
  if (std::fgets(line, sizeof(line), pipe) != nullptr) {
    run.core = std::string(absl::StripAsciiWhitespace(line));
  }
  if (pclose(pipe) != 0) run.core = "failed";
  std::ifstream in(out, std::ios::binary | std::ios::ate);
  run.values.resize(static_cast<size_t>(in.tellg()) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(run.values.data()), run.values.size() * sizeof(float));
  return run;
}

TEST(BlasKernelTest, ChosenCoreAgreesWithTheGenericKernel) {
  if (!LoadedOpenBlas().has_value()) {
    GTEST_SKIP() << "LibTorch's BLAS here is not OpenBLAS: there is no core to choose";
  }
  const std::string best = BestOpenBlasCore(ReadCpuFeatures());
  if (best.empty()) GTEST_SKIP() << "this CPU has no vector ISA beyond the generic kernels";
  const ProductRun generic = Products("Prescott");
  const ProductRun chosen = Products(best);
  // Each ran on the core it asked for: the comparison is between kernels.
  EXPECT_EQ(absl::AsciiStrToLower(generic.core), "prescott");
  EXPECT_EQ(absl::AsciiStrToLower(chosen.core), absl::AsciiStrToLower(best));
  ASSERT_FALSE(generic.values.empty());
  ASSERT_EQ(generic.values.size(), chosen.values.size());
  // Sums of up to 512 products of N(0,1) values: |c| ~ 20; a different
  // summation order moves the last bits only.
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < generic.values.size(); ++i) {
    const double diff = std::fabs(double{generic.values[i]} - chosen.values[i]);
    worst = std::max(worst, diff);
    if (diff > 1e-4 + 1e-5 * std::fabs(generic.values[i])) ++bad;
  }
  EXPECT_EQ(bad, 0u) << "worst difference " << worst;
  std::printf("%zu products, Prescott vs %s: worst difference %.3g\n", generic.values.size(),
              best.c_str(), worst);
}

}  // namespace
}  // namespace geotrain
