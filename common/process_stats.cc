#include "common/process_stats.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace geotrain {

uint64_t ResidentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  if (n != 2) return 0;
  return static_cast<uint64_t>(resident) * sysconf(_SC_PAGESIZE);
}

namespace {
// Reads "<key> <value> kB" from a /proc file.
uint64_t ReadKilobytes(const char* path, const char* key) {
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kb = 0;
  const size_t key_length = std::strlen(key);
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long long value = 0;
    if (std::strncmp(line, key, key_length) == 0 &&
        std::sscanf(line + key_length, " %llu kB", &value) == 1) {
      kb = value;
      break;
    }
  }
  std::fclose(f);
  return kb * 1024;
}
}  // namespace

uint64_t PeakResidentBytes() { return ReadKilobytes("/proc/self/status", "VmHWM:"); }

uint64_t AvailableMemoryBytes() { return ReadKilobytes("/proc/meminfo", "MemAvailable:"); }

}  // namespace geotrain
