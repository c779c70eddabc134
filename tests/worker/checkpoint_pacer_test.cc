#include "worker/checkpoint_pacer.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// A link sending `bytes_per_s`, its microbatch taking `link_s` on the wire
// against `compute_s` of compute.
v1::LinkStats Link(double bytes_per_s, double link_s, double compute_s) {
  v1::LinkStats link;
  link.set_link_rate_bps(bytes_per_s * 8);
  link.set_link_s_per_microbatch(link_s);
  link.set_compute_s_per_microbatch(compute_s);
  return link;
}

TEST(UploadPaceFromLinksTest, HalfOfWhatTheMicrobatchesLeave) {
  v1::StageStats stats;
  *stats.add_links() = Link(10e6, 0.02, 0.1);  // 20% busy: 0.5 * 0.8 of 10 MB/s
  EXPECT_DOUBLE_EQ(UploadPaceFromLinks(stats, 0.5, 0.05), 4e6);
}

TEST(UploadPaceFromLinksTest, ALinkBoundStageKeepsTheMinimumShare) {
  v1::StageStats stats;
  *stats.add_links() = Link(10e6, 0.3, 0.1);  // the link is the bottleneck
  EXPECT_DOUBLE_EQ(UploadPaceFromLinks(stats, 0.5, 0.05), 0.05 * 10e6);
}

TEST(UploadPaceFromLinksTest, TheSlowestLinkSetsThePace) {
  v1::StageStats stats;
  *stats.add_links() = Link(100e6, 0, 0.1);  // idle: 0.5 of 100 MB/s
  *stats.add_links() = Link(2e6, 0, 0.1);   // idle: 0.5 of 2 MB/s
  EXPECT_DOUBLE_EQ(UploadPaceFromLinks(stats, 0.5, 0.05), 1e6);
}

TEST(UploadPaceFromLinksTest, UnknownRatesGiveNoPace) {
  v1::StageStats stats;
  EXPECT_EQ(UploadPaceFromLinks(stats, 0.5, 0.05), 0);
  *stats.add_links() = Link(0, 0.01, 0.1);  // not measured yet
  EXPECT_EQ(UploadPaceFromLinks(stats, 0.5, 0.05), 0);
  // No compute figure yet: the link counts as idle.
  stats.clear_links();
  *stats.add_links() = Link(10e6, 0.01, 0);
  EXPECT_DOUBLE_EQ(UploadPaceFromLinks(stats, 0.5, 0.05), 5e6);
}

TEST(CheckpointPacerTest, UnpacedUntilALinkRateIsKnown) {
  FakeClock clock;
  CheckpointPacer pacer({}, &clock);
  EXPECT_EQ(pacer.bytes_per_s(), 0);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(pacer.Reserve(kMiB), absl::ZeroDuration());
}

TEST(CheckpointPacerTest, PartsGoOutAtThePaceAfterOneBurst) {
  FakeClock clock;
  CheckpointPacingOptions options;
  options.burst_bytes = kMiB;
  CheckpointPacer pacer(options, &clock);
  v1::StageStats stats;
  *stats.add_links() = Link(4.0 * kMiB, 0, 0.1);  // idle: 0.5 of 4 MiB/s
  pacer.Observe(stats);
  ASSERT_DOUBLE_EQ(pacer.bytes_per_s(), 2.0 * kMiB);
  // 1 MiB parts at 2 MiB/s: the first goes at once, each next 500 ms later.
  EXPECT_EQ(pacer.Reserve(kMiB), absl::ZeroDuration());
  EXPECT_EQ(pacer.Reserve(kMiB), absl::Milliseconds(500));
  EXPECT_EQ(pacer.Reserve(kMiB), absl::Milliseconds(1000));
  // The caller waited for the third: 8 MiB in all take 3.5 s from the start.
  clock.AdvanceMs(1000);
  absl::Duration last;
  for (int i = 0; i < 5; ++i) last = pacer.Reserve(kMiB);
  EXPECT_EQ(last, absl::Milliseconds(2500));
  // After a long idle period only one burst goes without waiting.
  clock.AdvanceMs(60000);
  EXPECT_EQ(pacer.Reserve(kMiB), absl::ZeroDuration());
  EXPECT_EQ(pacer.Reserve(kMiB), absl::Milliseconds(500));
}

TEST(CheckpointPacerTest, PacedPartsHoldTheUplinkBriefly) {
  FakeClock clock;
  CheckpointPacer pacer(CheckpointPacingOptions{}, &clock);
  // Unpaced (no link measured yet): whole 1 MiB parts.
  EXPECT_EQ(pacer.PartBytes(), kMiB);
  // A link-bound stage on a 5 Mb/s uplink: 5% of it, 31.25 kB/s. A part is
  // the 16 KiB floor (26 ms of the link), not 1 MiB (1.7 s of it).
  v1::StageStats thin;
  *thin.add_links() = Link(5e6 / 8, 1.0, 1.0);
  pacer.Observe(thin);
  ASSERT_DOUBLE_EQ(pacer.bytes_per_s(), 31250);
  EXPECT_EQ(pacer.PartBytes(), 16u << 10);
  // 20 parts after an idle period: one 64 KiB burst, then the pace.
  absl::Duration last;
  for (int i = 0; i < 20; ++i) last = pacer.Reserve(16u << 10);
  EXPECT_NEAR(absl::ToDoubleSeconds(last), (20 - 4) * 16384 / 31250.0, 1e-3);
  // An idle 1 Gb/s link: 50 ms at half of it is 3 MB, capped at 1 MiB.
  v1::StageStats fat;
  *fat.add_links() = Link(1e9 / 8, 0, 0.1);
  pacer.Observe(fat);
  EXPECT_EQ(pacer.PartBytes(), kMiB);
}

TEST(CheckpointPacerTest, LinksWithoutARateArePacedFromTheMeasuredUplink) {
  FakeClock clock;
  CheckpointPacer pacer(CheckpointPacingOptions{}, &clock);
  // Two links whose messages are too small to time: no rate of their own.
  // Together they send 400 kB/s of wire bytes (raw / compression ratio).
  v1::StageStats stats;
  for (double raw_bps : {6.4e6, 6.4e6}) {
    v1::LinkStats* link = stats.add_links();
    link->set_goodput_bps(raw_bps);
    link->set_compression_ratio(4);
  }
  pacer.Observe(stats);
  EXPECT_EQ(pacer.bytes_per_s(), 0) << "no uplink measured yet: unpaced";
  // Measures toward peers: 2 and 4 Mb/s; the uplink is the faster, 500 kB/s.
  pacer.ObserveUplink(2e6 / 8);
  pacer.ObserveUplink(4e6 / 8);
  pacer.Observe(stats);
  // 80% of it busy: half of the 20% left.
  EXPECT_NEAR(pacer.bytes_per_s(), 0.5 * 0.2 * 500e3, 1e-6);
  // Links that send all the uplink carries: the minimum share.
  EXPECT_NEAR(UploadPaceFromUplink(stats, 300e3, 0.5, 0.05), 0.05 * 300e3, 1e-6);
  // A link with a rate of its own sets the pace as before.
  *stats.add_links() = Link(1e6, 0, 0.1);
  pacer.Observe(stats);
  EXPECT_DOUBLE_EQ(pacer.bytes_per_s(), 0.5e6);
}

TEST(CheckpointPacerTest, AStageBetweenPlansKeepsItsLastPace) {
  FakeClock clock;
  CheckpointPacer pacer({}, &clock);
  v1::StageStats stats;
  *stats.add_links() = Link(10e6, 0, 0.1);
  pacer.Observe(stats);
  pacer.Observe(v1::StageStats());  // no links while re-planning
  EXPECT_DOUBLE_EQ(pacer.bytes_per_s(), 5e6);
}

TEST(CheckpointPacerTest, AFixedRateOrNoneOverridesTheLinks) {
  FakeClock clock;
  v1::StageStats stats;
  *stats.add_links() = Link(10e6, 0, 0.1);
  CheckpointPacingOptions fixed;
  fixed.fixed_bytes_per_s = 1e6;
  CheckpointPacer paced(fixed, &clock);
  paced.Observe(stats);
  EXPECT_DOUBLE_EQ(paced.bytes_per_s(), 1e6);
  CheckpointPacingOptions none;
  none.fixed_bytes_per_s = -1;
  CheckpointPacer unpaced(none, &clock);
  unpaced.Observe(stats);
  EXPECT_EQ(unpaced.bytes_per_s(), 0);
  EXPECT_EQ(unpaced.Reserve(100 * kMiB), absl::ZeroDuration());
}

}  // namespace
}  // namespace geotrain
