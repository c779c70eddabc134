#include "bench/swarm/swarm_model.h"

#include "bench/common/dtfm_regions.h"

namespace geotrain::swarm {
namespace {

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

const char* RegionName(int region) { return bench::RegionName(region % kRegions); }

LinkFigures LinkBetween(int a, int b) {
  a %= kRegions;
  b %= kRegions;
  LinkFigures figures;
  figures.rtt_s = 2 * bench::OneWayDelayMs(a, b) / 1e3;
  figures.rate_bps = bench::RateBps(a, b);
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
