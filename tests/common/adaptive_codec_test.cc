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

TEST(LinkRateMeterTest, OldSamplesAgeOut) {
  LinkRateMeter meter(/*window=*/4);
  for (int i = 0; i < 4; ++i) meter.OnMessage(125000, absl::Milliseconds(1), false);
  EXPECT_NEAR(meter.rate_bps(), 1e9, 1e4);
  for (int i = 0; i < 4; ++i) meter.OnMessage(125000, absl::Milliseconds(10), false);
  EXPECT_NEAR(meter.rate_bps(), 100e6, 1e3);  // the link slowed down
}

}  // namespace
}  // namespace geotrain
