#include "worker/compute_environment.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "worker/thread_share.h"

namespace geotrain {
namespace {

CpuFeatures Avx512Cpu() {
  CpuFeatures cpu;
  cpu.vendor = "GenuineIntel";
  cpu.family = 6;
  cpu.model = 207;
  cpu.avx = cpu.avx2 = cpu.fma = cpu.avx512 = true;
  return cpu;
}

CpuFeatures Avx2Cpu() {
  CpuFeatures cpu;
  cpu.vendor = "AuthenticAMD";
  cpu.family = 25;
  cpu.model = 1;
  cpu.avx = cpu.avx2 = cpu.fma = true;
  return cpu;
}

TEST(BestOpenBlasCoreTest, FollowsTheVectorIsa) {
  CpuFeatures none;
  EXPECT_EQ(BestOpenBlasCore(none), "");
  CpuFeatures avx;
  avx.avx = true;
  EXPECT_EQ(BestOpenBlasCore(avx), "Sandybridge");
  EXPECT_EQ(BestOpenBlasCore(Avx2Cpu()), "Haswell");
  EXPECT_EQ(BestOpenBlasCore(Avx512Cpu()), "SkylakeX");
  CpuFeatures avx2_no_fma = Avx2Cpu();
  avx2_no_fma.fma = false;
  EXPECT_EQ(BestOpenBlasCore(avx2_no_fma), "Sandybridge");
}

TEST(IsWeakerOpenBlasCoreTest, RanksCoresByTheirKernels) {
  struct Case {
    const char* detected;
    const char* best;
    bool weaker;
  };
  for (const Case& c : {Case{"Prescott", "SkylakeX", true}, Case{"Prescott", "Haswell", true},
                        Case{"Unknown", "Sandybridge", true}, Case{"Nehalem", "Haswell", true},
                        Case{"Haswell", "SkylakeX", true}, Case{"Zen", "SkylakeX", true},
                        Case{"SkylakeX", "SkylakeX", false}, Case{"Zen", "Haswell", false},
                        Case{"SAPPHIRERAPIDS", "SkylakeX", false},
                        Case{"Cooperlake", "SkylakeX", false}, Case{"Haswell", "Haswell", false},
                        Case{"Prescott", "", false}}) {
    EXPECT_EQ(IsWeakerOpenBlasCore(c.detected, c.best), c.weaker)
        << c.detected << " vs " << c.best;
  }
}

EnvLookup Env(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

std::map<std::string, std::string> Settings(const EnvironmentPlan& plan) {
  return std::map<std::string, std::string>(plan.set.begin(), plan.set.end());
}

TEST(PlanComputeEnvironmentTest, RaisesAGenericCoreOnACpuThatCanDoBetter) {
  const EnvironmentPlan plan =
      PlanComputeEnvironment(Env({}), OpenBlasInfo{"Prescott", "OpenBLAS 0.3.21 DYNAMIC_ARCH"}, Avx512Cpu());
  EXPECT_EQ(Settings(plan).at("OPENBLAS_CORETYPE"), "SkylakeX");
  ASSERT_FALSE(plan.notes.empty());
  EXPECT_NE(plan.notes[0].find("had picked Prescott"), std::string::npos) << plan.notes[0];
  EXPECT_NE(plan.notes[0].find("family 6 model 207"), std::string::npos) << plan.notes[0];
}

TEST(PlanComputeEnvironmentTest, AStaticBuildHasNoOtherCoreToChoose) {
  const EnvironmentPlan plan = PlanComputeEnvironment(
      Env({}), OpenBlasInfo{"Prescott", "OpenBLAS 0.3.21 NO_AFFINITY Prescott"}, Avx512Cpu());
  EXPECT_EQ(Settings(plan).count("OPENBLAS_CORETYPE"), 0u);
}

TEST(PlanComputeEnvironmentTest, NeverOverridesTheUsersCore) {
  const EnvironmentPlan plan =
      PlanComputeEnvironment(Env({{"OPENBLAS_CORETYPE", "Prescott"}}),
                             OpenBlasInfo{"Prescott", "OpenBLAS 0.3.21 DYNAMIC_ARCH"}, Avx512Cpu());
  EXPECT_EQ(Settings(plan).count("OPENBLAS_CORETYPE"), 0u);
}

TEST(PlanComputeEnvironmentTest, LeavesARightCoreAlone) {
  EXPECT_EQ(Settings(PlanComputeEnvironment(Env({}), OpenBlasInfo{"Zen", "OpenBLAS 0.3.21 DYNAMIC_ARCH"},
                                            Avx2Cpu()))
                .count("OPENBLAS_CORETYPE"),
            0u);
  EXPECT_EQ(Settings(PlanComputeEnvironment(Env({}), OpenBlasInfo{"SkylakeX", "OpenBLAS DYNAMIC_ARCH"},
                                            Avx512Cpu()))
                .count("OPENBLAS_CORETYPE"),
            0u);
}

TEST(PlanComputeEnvironmentTest, WithoutOpenBlasOnlyOpenMpIsSet) {
  const EnvironmentPlan plan = PlanComputeEnvironment(Env({}), std::nullopt, Avx512Cpu());
  EXPECT_EQ(Settings(plan), (std::map<std::string, std::string>{{"OMP_WAIT_POLICY", "PASSIVE"}}));
}

TEST(PlanComputeEnvironmentTest, KeepsTheUsersOpenMpPolicy) {
  EXPECT_TRUE(PlanComputeEnvironment(Env({{"OMP_WAIT_POLICY", "ACTIVE"}}), std::nullopt,
                                     Avx512Cpu())
                  .set.empty());
}

TEST(PlanComputeEnvironmentTest, AReexecutedProcessChangesNothing) {
  EXPECT_TRUE(PlanComputeEnvironment(Env({{"GEOTRAIN_COMPUTE_ENVIRONMENT", "done"}}),
                                     OpenBlasInfo{"Prescott", "OpenBLAS DYNAMIC_ARCH"}, Avx512Cpu())
                  .set.empty());
}

TEST(ReadCpuFeaturesTest, AgreesWithItself) {
  const CpuFeatures cpu = ReadCpuFeatures();
  // AVX2 implies AVX; AVX-512 here requires AVX2.
  if (cpu.avx2) EXPECT_TRUE(cpu.avx);
  if (cpu.avx512) EXPECT_TRUE(cpu.avx2);
#if defined(__x86_64__)
  EXPECT_FALSE(cpu.vendor.empty());
#endif
}

TEST(ChooseThreadsTest, SharesTheHostFairly) {
  struct Case {
    int requested, cpus, workers, threads;
  };
  for (const Case& c : {Case{0, 2, 1, 2}, Case{0, 2, 2, 1}, Case{0, 2, 3, 1}, Case{0, 16, 3, 5},
                        Case{0, 8, 0, 8}, Case{3, 2, 3, 3}}) {
    const ThreadShare share = ChooseThreads(c.requested, c.cpus, c.workers);
    EXPECT_EQ(share.threads, c.threads) << c.requested << " " << c.cpus << " " << c.workers;
    EXPECT_FALSE(share.reason.empty());
  }
  EXPECT_EQ(ChooseThreads(0, 2, 3).reason, "fair share: 2 CPUs / 3 workers on this host");
  EXPECT_EQ(ChooseThreads(4, 2, 3).reason, "--threads");
}

TEST(ThreadShareTest, ReadsThisHost) {
  EXPECT_GE(UsableCpuCount(), 1);
  EXPECT_GE(WorkersOnHost(), 1);
}

}  // namespace
}  // namespace geotrain
