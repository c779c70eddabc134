// The process environment that LibTorch's CPU kernels read once, when their
// libraries load: which OpenBLAS core (OPENBLAS_CORETYPE) and how OpenMP's
// idle threads wait (OMP_WAIT_POLICY). Both are fixed before main() runs, so
// a worker that finds them wrong re-executes itself with them set, once,
// before it does anything else.
//
// Why: Debian's OpenBLAS 0.3.21 does not know recent CPUs (e.g. family 6
// model 207) and falls back to its generic Prescott kernel, a third of the
// speed of the right one; and OpenMP threads that spin while idle steal the
// cores of the other workers on a shared host.
//
// Rules: a value the user set is never changed (some CPUs need a specific
// core because some OpenBLAS builds compute wrong results on them); the
// core is only raised (in a DYNAMIC_ARCH build, which carries every
// kernel), to the best one the CPU's features (CPUID, with the
// OS's XSAVE support) allow, and only when OpenBLAS picked a weaker one.
//
// Torch-free; thread-compatible (call from main() before any thread starts).
#ifndef GEOTRAIN_WORKER_COMPUTE_ENVIRONMENT_H_
#define GEOTRAIN_WORKER_COMPUTE_ENVIRONMENT_H_

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace geotrain {

// What the CPU and the OS together let code use.
struct CpuFeatures {
  std::string vendor;  // "GenuineIntel", "AuthenticAMD", ...
  int family = 0;
  int model = 0;
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool avx512 = false;  // F, BW, VL, DQ and CD, with OS support for ZMM state
};

// Reads CPUID (all false off x86).
CpuFeatures ReadCpuFeatures();

// The strongest OpenBLAS DYNAMIC_ARCH core name `cpu` can run: "SkylakeX",
// "Haswell", "SandyBridge", or "" when only generic kernels fit.
std::string BestOpenBlasCore(const CpuFeatures& cpu);

// True when OpenBLAS's `detected` core is weaker than `best` (an unknown or
// generic core name counts as weakest; AMD's and Intel's names are ranked
// by the vector ISA their kernels use).
bool IsWeakerOpenBlasCore(const std::string& detected, const std::string& best);

// The loaded OpenBLAS's core and config ("Zen", "OpenBLAS 0.3.21 ...
// DYNAMIC_ARCH ... Zen ..."), or nullopt when LibTorch's BLAS is not
// OpenBLAS (e.g. MKL inside PyPI's torch wheel).
struct OpenBlasInfo {
  std::string core;
  std::string config;
};
std::optional<OpenBlasInfo> LoadedOpenBlas();

// Environment variables to set, and why, given the current environment
// (`getenv`-like lookup), the loaded OpenBLAS (if any) and the CPU. Pure, so
// tests can drive every case.
struct EnvironmentPlan {
  std::vector<std::pair<std::string, std::string>> set;  // name, value
  std::vector<std::string> notes;                        // one per decision
};
using EnvLookup = std::function<const char*(const char*)>;
EnvironmentPlan PlanComputeEnvironment(const EnvLookup& env,
                                       const std::optional<OpenBlasInfo>& openblas,
                                       const CpuFeatures& cpu);

// Applies PlanComputeEnvironment to this process: when it sets anything,
// re-executes this binary (by its path) with `argv` and the new environment (marked, so
// this happens at most once). Returns only when nothing needed setting, or
// the exec failed (then the worker runs as it is, and the note says so).
void ReexecWithComputeEnvironment(char** argv);

// What the (possibly re-executed) process did: e.g. "OPENBLAS_CORETYPE=
// SkylakeX set by geotrain (OpenBLAS had picked Prescott)". Empty when
// nothing was changed.
std::string ComputeEnvironmentNote();

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_COMPUTE_ENVIRONMENT_H_
