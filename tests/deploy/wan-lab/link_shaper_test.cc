#include "deploy/wan-lab/link_shaper.h"

#include "deploy/wan-lab/link_profile.h"
#include "gtest/gtest.h"

namespace geotrain::wanlab {
namespace {

LinkShape Shape(double rate_mbit, int64_t delay_us, int64_t burst, int64_t queue) {
  LinkShape shape;
  shape.rate_bps = rate_mbit * 1e6;
  shape.delay_us = delay_us;
  shape.burst_bytes = burst;
  shape.queue_bytes = queue;
  return shape;
}

TEST(LinkShaperTest, UnlimitedRateOnlyDelays) {
  LinkShaper shaper(Shape(0, 50000, 0, 1000));
  EXPECT_EQ(shaper.Admit(1000, 1 << 20), 51000);
  EXPECT_EQ(shaper.AdmitWaitUs(1000, 1 << 30), 0);
  EXPECT_EQ(shaper.BacklogBytes(1000), 0);
}

TEST(LinkShaperTest, BackToBackChunksLeaveAtTheRate) {
  // 8 Mb/s = 1 byte per microsecond; no burst credit.
  LinkShaper shaper(Shape(8, 10000, 0, 1 << 20));
  EXPECT_EQ(shaper.Admit(0, 1000), 1000 + 10000);
  EXPECT_EQ(shaper.Admit(0, 1000), 2000 + 10000);
  EXPECT_EQ(shaper.Admit(500, 1000), 3000 + 10000);
  EXPECT_EQ(shaper.BacklogBytes(500), 2500);
}

TEST(LinkShaperTest, IdleTimeEarnsAtMostTheBurst) {
  LinkShaper shaper(Shape(8, 0, 4000, 1 << 20));
  // After a long idle time, 4000 bytes go at once, the rest at the rate.
  EXPECT_EQ(shaper.Admit(1000000, 4000), 1000000);
  EXPECT_EQ(shaper.Admit(1000000, 1000), 1001000);
}

TEST(LinkShaperTest, QueueCapHoldsTheSenderBack) {
  LinkShaper shaper(Shape(8, 0, 0, 3000));
  shaper.Admit(0, 3000);
  // The queue is full: the next 1000 bytes wait until 1000 have left.
  EXPECT_EQ(shaper.AdmitWaitUs(0, 1000), 1000);
  EXPECT_EQ(shaper.AdmitWaitUs(1000, 1000), 0);
  // A chunk bigger than the cap waits for an empty queue, not forever.
  EXPECT_EQ(shaper.AdmitWaitUs(1000, 10000), 2000);
  EXPECT_EQ(shaper.AdmitWaitUs(3000, 10000), 0);
}

TEST(LinkShaperTest, DeliveryTimesNeverDecrease) {
  LinkShaper shaper(Shape(100, 5000, 16384, 1 << 20));
  int64_t last = 0;
  for (int64_t now = 0; now < 100000; now += 37) {
    const int64_t at = shaper.Admit(now, 100 + now % 5000);
    EXPECT_GE(at, last);
    last = at;
  }
}

TEST(LinkShaperTest, ANewShapeAppliesToWhatIsAdmittedNextAndOrderHolds) {
  LinkShape fast;
  fast.rate_bps = 8e6;  // 1 byte per microsecond
  fast.delay_us = 50000;
  fast.burst_bytes = 1;
  LinkShaper shaper(fast);
  const int64_t first = shaper.Admit(0, 1000);  // 1 ms on the wire + 50 ms
  EXPECT_NEAR(first, 51000, 2);
  // A tenth of the rate and no delay: the next chunk serialises 10x slower,
  // and is not delivered before the one already in flight.
  LinkShape slow = fast;
  slow.rate_bps = 8e5;
  slow.delay_us = 0;
  shaper.SetShape(slow);
  const int64_t second = shaper.Admit(1000, 1000);
  EXPECT_GE(second, first);
  const int64_t third = shaper.Admit(100000, 1000);
  EXPECT_NEAR(third - 100000, 10000, 15);  // 10 ms for 1000 bytes now (less a byte of burst)
  EXPECT_EQ(shaper.shape().rate_bps, 8e5);
}

TEST(LinkProfileTest, ProfilesFromTheDesign) {
  auto tokyo = FindLinkProfile("tokyo-london");
  ASSERT_TRUE(tokyo.ok());
  EXPECT_EQ(tokyo->delay_ms, 210);
  EXPECT_EQ(tokyo->rate_mbit, 366);
  for (const char* name : {"region", "us-east-west", "home-100mbit", "home-10mbit"}) {
    EXPECT_TRUE(FindLinkProfile(name).ok()) << name;
  }
  auto unknown = FindLinkProfile("mars");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("home-10mbit"), std::string::npos);
}

}  // namespace
}  // namespace geotrain::wanlab
