// The five regions of DT-FM's geo-distributed scenario, as the benches
// model them (bench/planner, bench/swarm): one-way delay and rate between
// every pair. DESIGN.md gives same region 5 ms / 2 Gb/s, Oregon-Virginia
// 67 ms / 0.79 Gb/s, Tokyo-London (here Tokyo-Frankfurt) 210 ms /
// 0.366 Gb/s and Sydney-Frankfurt 265 ms / 0.328 Gb/s. The other pairs'
// delays are rough public figures, and their rates are interpolated from
// the measured pairs by delay.
#ifndef GEOTRAIN_BENCH_COMMON_DTFM_REGIONS_H_
#define GEOTRAIN_BENCH_COMMON_DTFM_REGIONS_H_

namespace geotrain::bench {

inline constexpr int kRegions = 5;  // oregon, virginia, frankfurt, tokyo, sydney

// REQUIRES: 0 <= region < kRegions (as for every function below).
const char* RegionName(int region);
double OneWayDelayMs(int region_a, int region_b);
double RateBps(int region_a, int region_b);

}  // namespace geotrain::bench

#endif  // GEOTRAIN_BENCH_COMMON_DTFM_REGIONS_H_
