#include "bench/swarm/swarm_model.h"

namespace geotrain::swarm {
namespace {

const char* const kRegionNames[kRegions] = {"oregon", "virginia", "frankfurt", "tokyo", "sydney"};

// One-way delays (ms) between the regions.
const double kDelayMs[kRegions][kRegions] = {{5, 67, 80, 50, 70},
                                             {67, 5, 45, 85, 100},
                                             {80, 45, 5, 210, 265},
                                             {50, 85, 210, 5, 55},
                                             {70, 100, 265, 55, 5}};

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

SpeedClass Class(const char* name, const char* device, double gflops, uint64_t memory,
                 double block_s) {
  return {name,
          device,
          gflops,
          memory,
          {{"embed", block_s / 4}, {"block", block_s}, {"head", block_s * 2}, {"linear", block_s}}};
}

}  // namespace

int RegionOf(int index) { return index % kRegions; }

const char* RegionName(int region) { return kRegionNames[region % kRegions]; }

LinkFigures LinkBetween(int a, int b) {
  a %= kRegions;
  b %= kRegions;
  LinkFigures figures;
  figures.rtt_s = 2 * kDelayMs[a][b] / 1e3;
  figures.rate_bps = a == b ? 2e9 : RateForDelay(kDelayMs[a][b]);
  if ((a == 0 && b == 1) || (a == 1 && b == 0)) figures.rate_bps = 0.79e9;
  if ((a == 2 && b == 3) || (a == 3 && b == 2)) figures.rate_bps = 0.366e9;
  if ((a == 2 && b == 4) || (a == 4 && b == 2)) figures.rate_bps = 0.328e9;
  return figures;
}

const SpeedClass& SpeedClassOf(int index) {
  static const SpeedClass gpu = Class("gpu", "cuda:0", 20000, 16ull << 30, 2e-6);
  static const SpeedClass fast = Class("fast-cpu", "cpu", 200, 8ull << 30, 2e-4);
  static const SpeedClass slow = Class("slow-cpu", "cpu", 40, 4ull << 30, 1e-3);
  const int slot = index % 10;
  if (slot == 0) return gpu;
  return slot <= 3 ? fast : slow;
}

v1::DeviceInfo DeviceOf(int index) {
  const SpeedClass& speed = SpeedClassOf(index);
  v1::DeviceInfo device;
  device.set_device(speed.device);
  device.set_matmul_gflops(speed.matmul_gflops);
  device.set_memory_bytes(speed.memory_bytes);
  device.set_memory_total_bytes(speed.memory_bytes);
  device.set_threads(speed.device[0] == 'c' && speed.device[1] == 'p' ? 4 : 1);
  device.set_blas(speed.name);
  return device;
}

}  // namespace geotrain::swarm
