#include "common/adaptive_codec.h"

#include "common/link_rate_meter.h"
#include "gtest/gtest.h"

namespace geotrain {
namespace {

TEST(CodecLadderTest, EndsAtTheStrongestAllowed) {
  EXPECT_EQ(CodecLadder(v1::CODEC_NONE), (std::vector<v1::Codec>{v1::CODEC_NONE}));
  EXPECT_EQ(CodecLadder(v1::CODEC_INT8),
            (std::vector<v1::Codec>{v1::CODEC_NONE, v1::CODEC_FP16, v1::CODEC_INT8}));
  EXPECT_EQ(CodecLadder(v1::CODEC_INT4).back(), v1::CODEC_INT4);
  EXPECT_EQ(CodecLadder(v1::CODEC_BF16).back(), v1::CODEC_BF16);
  EXPECT_LT(NominalCodecRatio(v1::CODEC_INT4), NominalCodecRatio(v1::CODEC_INT8));
}

TEST(CodecLadderTest, CapToLadderKeepsTheStepOnTheDirectionsOwnLadder) {
  EXPECT_EQ(CapToLadder(v1::CODEC_INT8, v1::CODEC_INT8), v1::CODEC_INT8);
  EXPECT_EQ(CapToLadder(v1::CODEC_INT8, v1::CODEC_FP16), v1::CODEC_FP16);
  EXPECT_EQ(CapToLadder(v1::CODEC_INT8, v1::CODEC_NONE), v1::CODEC_NONE);
  EXPECT_EQ(CapToLadder(v1::CODEC_FP16, v1::CODEC_BF16), v1::CODEC_BF16);
  EXPECT_EQ(CapToLadder(v1::CODEC_INT4, v1::CODEC_TOPK), v1::CODEC_TOPK);
  EXPECT_EQ(CapToLadder(v1::CODEC_NONE, v1::CODEC_INT4), v1::CODEC_NONE);
  EXPECT_EQ(CapToLadder(v1::CODEC_UNSPECIFIED, v1::CODEC_INT8), v1::CODEC_INT8);
}

TEST(AdaptiveCodecSelectorTest, StepsUpWhileLinkBoundAfterPatience) {
  AdaptiveCodecSelector selector(CodecLadder(v1::CODEC_INT4));
  EXPECT_EQ(selector.codec(), v1::CODEC_NONE);
  EXPECT_FALSE(selector.Observe(0.080, 0.020));
  EXPECT_FALSE(selector.Observe(0.080, 0.020));
  EXPECT_TRUE(selector.Observe(0.080, 0.020));
  EXPECT_EQ(selector.codec(), v1::CODEC_FP16);
  EXPECT_NE(selector.reason().find("link-bound"), std::string::npos) << selector.reason();
  EXPECT_NE(selector.reason().find("none -> fp16"), std::string::npos) << selector.reason();
  // At fp16 the wire time halves: still link-bound, so on to int8.
  for (int i = 0; i < 3; ++i) selector.Observe(0.040, 0.020);
  EXPECT_EQ(selector.codec(), v1::CODEC_INT8);
  // At int8 it is 19 ms, under the compute time; fp16 would be 36 ms: stay.
  for (int i = 0; i < 10; ++i) EXPECT_FALSE(selector.Observe(0.019, 0.020));
  EXPECT_EQ(selector.codec(), v1::CODEC_INT8);
  // Settled, it still says how it got there.
  EXPECT_EQ(selector.reason().rfind("balanced (", 0), 0u) << selector.reason();
  EXPECT_NE(selector.reason().find("last change: link-bound"), std::string::npos)
      << selector.reason();
  EXPECT_NE(selector.reason().find("fp16 -> int8"), std::string::npos) << selector.reason();
}

TEST(AdaptiveCodecSelectorTest, ANoisyObservationResetsTheCount) {
  AdaptiveCodecSelector selector(CodecLadder(v1::CODEC_INT8));
  selector.Observe(0.080, 0.020);
  selector.Observe(0.080, 0.020);
  selector.Observe(0.010, 0.020);  // compute-bound for once
  selector.Observe(0.080, 0.020);
  EXPECT_EQ(selector.codec(), v1::CODEC_NONE);
}

TEST(AdaptiveCodecSelectorTest, StepsDownOnlyWhenTheWeakerCodecWouldStillBeCheap) {
  AdaptiveCodecSelector selector(CodecLadder(v1::CODEC_INT8));
  for (int i = 0; i < 6; ++i) selector.Observe(0.100, 0.020);
  ASSERT_EQ(selector.codec(), v1::CODEC_INT8);
  // The link got faster: 4 ms at int8 would be ~7.5 ms at fp16, < 0.5 x 20.
  for (int i = 0; i < 3; ++i) selector.Observe(0.004, 0.020);
  EXPECT_EQ(selector.codec(), v1::CODEC_FP16);
  EXPECT_NE(selector.reason().find("compute-bound"), std::string::npos);
  // 6 ms at fp16 would be 12 ms at none: not under 10 ms, so it stays.
  for (int i = 0; i < 10; ++i) selector.Observe(0.006, 0.020);
  EXPECT_EQ(selector.codec(), v1::CODEC_FP16);
}

TEST(AdaptiveCodecSelectorTest, IgnoresMissingFigures) {
  AdaptiveCodecSelector selector(CodecLadder(v1::CODEC_INT8));
  for (int i = 0; i < 10; ++i) EXPECT_FALSE(selector.Observe(0, 0.020));
  for (int i = 0; i < 10; ++i) EXPECT_FALSE(selector.Observe(0.1, 0));
  EXPECT_EQ(selector.codec(), v1::CODEC_NONE);
}

TEST(LinkRateMeterTest, DispersionGivesTheRate) {
  LinkRateMeter meter;
  EXPECT_EQ(meter.rate_bps(), 0);
  // 125 kB after the first frame, 10 ms later: 100 Mb/s.
  meter.OnMessage(125000, absl::Milliseconds(10), false);
  EXPECT_NEAR(meter.rate_bps(), 100e6, 1e3);
  meter.OnMessage(125000, absl::Milliseconds(9), false);
  meter.OnMessage(125000, absl::Milliseconds(11), false);
  EXPECT_NEAR(meter.rate_bps(), 100e6, 1e3);  // the median
}

TEST(LinkRateMeterTest, SkipsStallsSingleFramesAndNoise) {
  LinkRateMeter meter;
  meter.OnMessage(125000, absl::Milliseconds(1), true);    // read in a burst
  meter.OnMessage(0, absl::Milliseconds(10), false);       // one frame only
  meter.OnMessage(125000, absl::Microseconds(20), false);  // scheduling noise
  EXPECT_EQ(meter.rate_bps(), 0);
}

// 8 frames of 12.5 kB each, the first at t0 and the others `gaps_us` apart.
std::vector<FrameArrival> Train(const std::vector<int>& gaps_us) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  std::vector<FrameArrival> frames{{t0, 12500}};
  for (int gap : gaps_us) frames.push_back({frames.back().at + absl::Microseconds(gap), 12500});
  return frames;
}

double RateOf(const TrainTiming& timing) {
  return 8.0 * timing.trailing_bytes / absl::ToDoubleSeconds(timing.dispersion);
}

TEST(TimeTrainTest, PacedFramesGiveTheLinkRate) {
  // 12.5 kB every 1 ms: 100 Mb/s, timed over all 7 frames after the first.
  const TrainTiming timing = TimeTrain(Train({1000, 1000, 1000, 1000, 1000, 1000, 1000}));
  EXPECT_EQ(timing.trailing_bytes, 7 * 12500u);
  EXPECT_EQ(timing.dispersion, absl::Milliseconds(7));
  EXPECT_NEAR(RateOf(timing), 100e6, 1e3);
}

TEST(TimeTrainTest, AReaderWokenLateDoesNotOverstateTheRate) {
  // Frames arrive every 1 ms, but the reader woke 2 ms late: it read frames
  // 0-2 in one burst, then the rest as they came. Timed from frame 0 this
  // reads 140 Mb/s; from the burst's last frame on, the true 100 Mb/s.
  const std::vector<FrameArrival> frames = Train({10, 10, 980, 1000, 1000, 1000, 1000});
  EXPECT_NEAR(8.0 * 7 * 12500 / absl::ToDoubleSeconds(frames.back().at - frames[0].at), 140e6,
              1e3);
  const TrainTiming timing = TimeTrain(frames);
  EXPECT_EQ(timing.trailing_bytes, 4 * 12500u);
  EXPECT_EQ(timing.dispersion, absl::Milliseconds(4));
  EXPECT_NEAR(RateOf(timing), 100e6, 1e3);
}

TEST(TimeTrainTest, ShortTrainsAndUnlimitedLinks) {
  EXPECT_EQ(TimeTrain({}).trailing_bytes, 0u);
  EXPECT_EQ(TimeTrain(Train({})).trailing_bytes, 0u);  // a single frame
  // Two frames: only the span from the first.
  const TrainTiming two = TimeTrain(Train({1000}));
  EXPECT_EQ(two.trailing_bytes, 12500u);
  EXPECT_EQ(two.dispersion, absl::Milliseconds(1));
  // Loopback: every span is under the noise floor; the whole train is
  // reported, and the meter skips it.
  const TrainTiming fast = TimeTrain(Train({5, 5, 5, 5, 5, 5, 5}));
  EXPECT_EQ(fast.trailing_bytes, 7 * 12500u);
  LinkRateMeter meter;
  meter.OnMessage(fast.trailing_bytes, fast.dispersion, false);
  EXPECT_EQ(meter.rate_bps(), 0);
}

TEST(LinkRateMeterTest, OldSamplesAgeOut) {
  LinkRateMeter meter(/*window=*/4);
  for (int i = 0; i < 4; ++i) meter.OnMessage(125000, absl::Milliseconds(1), false);
  EXPECT_NEAR(meter.rate_bps(), 1e9, 1e4);
  for (int i = 0; i < 4; ++i) meter.OnMessage(125000, absl::Milliseconds(10), false);
  EXPECT_NEAR(meter.rate_bps(), 100e6, 1e3);  // the link slowed down
}

}  // namespace
}  // namespace geotrain
