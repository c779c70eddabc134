#include "worker/thread_share.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

constexpr char kWorkerProcessName[] = "geotrain-worker";

// ceil(quota / period) from cgroup v2's "max 100000" or "150000 100000";
// 0 without a quota.
int CgroupCpuQuota() {
  std::ifstream in("/sys/fs/cgroup/cpu.max");
  std::string quota, period;
  if (!(in >> quota >> period) || quota == "max") return 0;
  double q = 0, p = 0;
  if (!absl::SimpleAtod(quota, &q) || !absl::SimpleAtod(period, &p) || q <= 0 || p <= 0) return 0;
  return std::max(1, static_cast<int>(std::ceil(q / p)));
}

}  // namespace

int UsableCpuCount() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  const int quota = CgroupCpuQuota();
  if (quota > 0) cpus = std::min(cpus, quota);
  return std::max(1, cpus);
}

int WorkersOnHost() {
  int count = 0;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return 1;
  while (dirent* entry = readdir(proc)) {
    int pid = 0;
    if (!absl::SimpleAtoi(entry->d_name, &pid)) continue;
    std::ifstream comm(absl::StrCat("/proc/", pid, "/comm"));
    std::string name;
    if (std::getline(comm, name) && name == kWorkerProcessName) ++count;
  }
  closedir(proc);
  return std::max(1, count);
}

ThreadShare ChooseThreads(int requested, int cpus, int workers) {
  ThreadShare share;
  if (requested > 0) {
    share.threads = requested;
    share.reason = "--threads";
    return share;
  }
  cpus = std::max(1, cpus);
  workers = std::max(1, workers);
  share.threads = std::max(1, cpus / workers);
  share.reason = absl::StrCat("fair share: ", cpus, " CPU", cpus == 1 ? "" : "s", " / ", workers,
                              " worker", workers == 1 ? "" : "s", " on this host");
  return share;
}

}  // namespace geotrain
