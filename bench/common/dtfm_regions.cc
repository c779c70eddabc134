#include "bench/common/dtfm_regions.h"

namespace geotrain::bench {
namespace {

const char* const kNames[kRegions] = {"oregon", "virginia", "frankfurt", "tokyo", "sydney"};

const double kDelayMs[kRegions][kRegions] = {{5, 67, 80, 50, 70},
                                             {67, 5, 45, 85, 100},
                                             {80, 45, 5, 210, 265},
                                             {50, 85, 210, 5, 55},
                                             {70, 100, 265, 55, 5}};

struct MeasuredPair {
  int a, b;
  double rate_bps;
};
const MeasuredPair kMeasured[] = {{0, 1, 0.79e9}, {2, 3, 0.366e9}, {2, 4, 0.328e9}};

// Rate (bits/s) for a one-way delay, interpolated between DESIGN.md's pairs.
double RateForDelay(double delay_ms) {
  const double points[][2] = {{5, 2e9}, {11, 1.12e9}, {67, 0.79e9}, {210, 0.366e9}, {265, 0.328e9}};
  if (delay_ms <= points[0][0]) return points[0][1];
  for (int i = 1; i < 5; ++i) {
    if (delay_ms <= points[i][0]) {
      const double f = (delay_ms - points[i - 1][0]) / (points[i][0] - points[i - 1][0]);
      return points[i - 1][1] + f * (points[i][1] - points[i - 1][1]);
    }
  }
  return points[4][1];
}

const MeasuredPair* FindMeasured(int a, int b) {
  for (const MeasuredPair& pair : kMeasured) {
    if ((pair.a == a && pair.b == b) || (pair.a == b && pair.b == a)) return &pair;
  }
  return nullptr;
}

}  // namespace

const char* RegionName(int region) { return kNames[region]; }

double OneWayDelayMs(int a, int b) { return kDelayMs[a][b]; }

double RateBps(int a, int b) {
  if (a == b) return 2e9;
  if (const MeasuredPair* pair = FindMeasured(a, b)) return pair->rate_bps;
  return RateForDelay(kDelayMs[a][b]);
}

}  // namespace geotrain::bench
