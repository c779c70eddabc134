// What the simulated swarm's fake workers pretend to be: a speed class
// (device, layer timings) and a region (the links to every other region),
// both a function of the worker's index, so every run is the same swarm.
//
// The regions are bench/planner's five (bench/common/dtfm_regions.h,
// DESIGN.md's DT-FM pairs). The speed classes are three: a GPU, a fast CPU
// and a slow one, in the proportions a volunteer swarm has (few GPUs).
#ifndef GEOTRAIN_BENCH_SWARM_SWARM_MODEL_H_
#define GEOTRAIN_BENCH_SWARM_SWARM_MODEL_H_

#include <map>
#include <string>

#include "bench/common/dtfm_regions.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain::swarm {

inline constexpr int kRegions = bench::kRegions;

// The region of worker `index` (round-robin: workers arrive from everywhere).
int RegionOf(int index);
const char* RegionName(int region);

struct LinkFigures {
  double rtt_s = 0;
  double rate_bps = 0;
};
// Between two regions (the same: 5 ms one way, 2 Gb/s).
LinkFigures LinkBetween(int region_a, int region_b);

struct SpeedClass {
  const char* name;
  const char* device;
  double matmul_gflops;
  uint64_t memory_bytes;
  // Forward + backward seconds per sample of one layer of each kind, for
  // the swarm's job (a small GPT), as a worker's layer benchmark reports.
  std::map<std::string, double> layer_seconds_per_sample;
};
// One in ten workers is a GPU, three are fast CPUs, six slow ones.
const SpeedClass& SpeedClassOf(int index);

// The device a fake worker joins with.
v1::DeviceInfo DeviceOf(int index);

}  // namespace geotrain::swarm

#endif  // GEOTRAIN_BENCH_SWARM_SWARM_MODEL_H_
