#include "worker/compute_environment.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace geotrain {
namespace {

// Set in the re-executed process: what the first one changed, and proof
// that it already did (so there is never a second exec).
constexpr char kNoteVariable[] = "GEOTRAIN_COMPUTE_ENVIRONMENT";

// OpenBLAS DYNAMIC_ARCH core names by the vector ISA of their kernels.
int CoreRank(const std::string& core) {
  static const auto* const kRanks = new std::map<std::string, int>{
      {"skylakex", 3},    {"cooperlake", 3},  {"sapphirerapids", 3},
      {"haswell", 2},     {"zen", 2},
      {"sandybridge", 1}, {"bulldozer", 1},   {"piledriver", 1},
      {"steamroller", 1}, {"excavator", 1},
  };
  auto it = kRanks->find(absl::AsciiStrToLower(core));
  return it == kRanks->end() ? 0 : it->second;
}

}  // namespace

CpuFeatures ReadCpuFeatures() {
  CpuFeatures cpu;
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return cpu;
  const unsigned max_leaf = eax;
  char vendor[13] = {0};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  cpu.vendor = vendor;
  __get_cpuid(1, &eax, &ebx, &ecx, &edx);
  const unsigned base_family = (eax >> 8) & 0xF;
  cpu.family = static_cast<int>(base_family == 0xF ? base_family + ((eax >> 20) & 0xFF)
                                                   : base_family);
  cpu.model = static_cast<int>(((eax >> 4) & 0xF) |
                               ((base_family == 6 || base_family == 0xF) ? ((eax >> 12) & 0xF0)
                                                                         : 0));
  const bool osxsave = (ecx >> 27) & 1;
  uint64_t xcr0 = 0;
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  const bool os_ymm = (xcr0 & 0x6) == 0x6;     // SSE and AVX state
  const bool os_zmm = (xcr0 & 0xE6) == 0xE6;   // plus opmask and ZMM state
  cpu.avx = os_ymm && ((ecx >> 28) & 1);
  cpu.fma = cpu.avx && ((ecx >> 12) & 1);
  if (max_leaf >= 7) {
    __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx);
    cpu.avx2 = cpu.avx && ((ebx >> 5) & 1);
    const bool f = (ebx >> 16) & 1, dq = (ebx >> 17) & 1, cd = (ebx >> 28) & 1,
               bw = (ebx >> 30) & 1, vl = (ebx >> 31) & 1;
    cpu.avx512 = os_zmm && f && dq && cd && bw && vl;
  }
#endif
  return cpu;
}

std::string BestOpenBlasCore(const CpuFeatures& cpu) {
  if (cpu.avx512 && cpu.avx2 && cpu.fma) return "SkylakeX";
  if (cpu.avx2 && cpu.fma) return "Haswell";
  if (cpu.avx) return "Sandybridge";
  return "";
}

bool IsWeakerOpenBlasCore(const std::string& detected, const std::string& best) {
  return CoreRank(detected) < CoreRank(best);
}

std::optional<OpenBlasInfo> LoadedOpenBlas() {
  using CharFn = char* (*)();
  auto corename = reinterpret_cast<CharFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  auto config = reinterpret_cast<CharFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
  if (corename == nullptr || config == nullptr) return std::nullopt;
  OpenBlasInfo info;
  info.core = corename();
  info.config = config();
  return info;
}

EnvironmentPlan PlanComputeEnvironment(const EnvLookup& env,
                                       const std::optional<OpenBlasInfo>& openblas,
                                       const CpuFeatures& cpu) {
  EnvironmentPlan plan;
  if (env(kNoteVariable) != nullptr) return plan;  // already re-executed once
  if (openblas.has_value()) {
    const char* user_core = env("OPENBLAS_CORETYPE");
    const std::string best = BestOpenBlasCore(cpu);
    // Only a DYNAMIC_ARCH build carries other kernels to switch to.
    const bool dynamic = openblas->config.find("DYNAMIC_ARCH") != std::string::npos;
    if (user_core != nullptr && *user_core != '\0') {
      // Never overridden: a set core may be what keeps results right.
    } else if (dynamic && !best.empty() && IsWeakerOpenBlasCore(openblas->core, best)) {
      plan.set.emplace_back("OPENBLAS_CORETYPE", best);
      plan.notes.push_back(absl::StrCat("OPENBLAS_CORETYPE=", best, " set by geotrain (OpenBLAS ",
                                        "had picked ", openblas->core, " on ", cpu.vendor,
                                        " family ", cpu.family, " model ", cpu.model, ")"));
    }
  }
  // Idle OpenMP threads spin for a while by default (libgomp: ~300k
  // iterations), which on a host shared by several workers burns the cores
  // the others compute on.
  if (env("OMP_WAIT_POLICY") == nullptr) {
    plan.set.emplace_back("OMP_WAIT_POLICY", "PASSIVE");
    plan.notes.push_back("OMP_WAIT_POLICY=PASSIVE set by geotrain");
  }
  return plan;
}

void ReexecWithComputeEnvironment(char** argv) {
  const EnvironmentPlan plan =
      PlanComputeEnvironment([](const char* name) { return std::getenv(name); }, LoadedOpenBlas(),
                             ReadCpuFeatures());
  if (plan.set.empty()) return;
  for (const auto& [name, value] : plan.set) setenv(name.c_str(), value.c_str(), 1);
  const std::string note = absl::StrJoin(plan.notes, "; ");
  setenv(kNoteVariable, note.c_str(), 1);
  // The binary's own path, not /proc/self/exe: the process name (comm)
  // comes from it, and WorkersOnHost() counts workers by that name.
  char self[4096] = {0};
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length > 0 && access(self, X_OK) == 0) execv(self, argv);
  execv("/proc/self/exe", argv);
  // Still here: run as we are, and say so.
  const std::string failed = absl::StrCat("re-exec to set ", note, " failed: ", strerror(errno));
  setenv(kNoteVariable, failed.c_str(), 1);
}

std::string ComputeEnvironmentNote() {
  const char* note = std::getenv(kNoteVariable);
  return note == nullptr ? "" : note;
}

}  // namespace geotrain
