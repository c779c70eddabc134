// Facts about this process and machine, read from /proc.
#ifndef GEOTRAIN_COMMON_PROCESS_STATS_H_
#define GEOTRAIN_COMMON_PROCESS_STATS_H_

#include <cstdint>

namespace geotrain {

// Resident set size of this process in bytes (0 if unknown).
uint64_t ResidentBytes();
// Peak resident set size (VmHWM) of this process in bytes (0 if unknown).
uint64_t PeakResidentBytes();
// MemAvailable of the machine in bytes (0 if unknown).
uint64_t AvailableMemoryBytes();

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_PROCESS_STATS_H_
