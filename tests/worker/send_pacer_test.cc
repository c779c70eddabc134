#include "worker/send_pacer.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/link_rate_meter.h"
#include "worker/link_end.h"

namespace geotrain {
namespace {

TEST(PartBytesAtTest, FiftyMillisecondsAtThePaceWithinBounds) {
  const PartSizing sizing;
  EXPECT_EQ(PartBytesAt(0, sizing), 1u << 20);             // unpaced: whole parts
  EXPECT_EQ(PartBytesAt(125e3, sizing), 16u << 10);        // 1 Mb/s: the floor
  EXPECT_EQ(PartBytesAt(2.5e6, sizing), 125000u);          // 20 Mb/s: 50 ms of it
  EXPECT_EQ(PartBytesAt(1.25e9, sizing), 1u << 20);        // 10 Gb/s: the cap
}

TEST(UplinkSharePacerTest, AShareOfTheMeasuredUplinkAndUnpacedBeforeAMeasure) {
  FakeClock clock;
  double uplink = 0;
  UplinkSharePacer pacer([&] { return uplink; }, 0.2, &clock, /*burst_bytes=*/0);
  EXPECT_EQ(pacer.bytes_per_s(), 0);
  EXPECT_EQ(pacer.Reserve(1 << 20), absl::ZeroDuration());
  uplink = 625e3;  // 5 Mb/s
  EXPECT_DOUBLE_EQ(pacer.bytes_per_s(), 125e3);
  EXPECT_EQ(pacer.PartBytes(), 16u << 10);
  // 1.6 MB of a new replica's outer state: 12.8 s at the share.
  absl::Duration last;
  for (int i = 0; i < 100; ++i) last = pacer.Reserve(16000);
  EXPECT_EQ(last, absl::Milliseconds(12800));
}

// Records the frames written; a pacer that counts its reservations.
class RecordingTransport : public LinkTransport {
 public:
  bool Read(IncomingFrame*) override { return false; }
  bool Write(const OutgoingFrame& frame) override {
    frames.push_back(frame.range);
    return true;
  }
  void Cancel() override {}
  void CloseWrites() override {}
  absl::Status Finish() override { return absl::OkStatus(); }
  std::string description() const override { return "recording"; }
  std::vector<FrameRange> frames;
};

class CountingPacer : public SendPacer {
 public:
  size_t PartBytes() const override { return 10000; }
  absl::Duration Reserve(uint64_t bytes) override {
    reserved.push_back(bytes);
    return absl::Milliseconds(1);
  }
  std::vector<uint64_t> reserved;
};

TEST(WriteLinkMessageTest, APacedMessageGoesInPacedPartsEachReserved) {
  auto message = std::make_shared<LinkMessage>();
  message->payload.assign(200000, 'x');
  RecordingTransport unpaced;
  ASSERT_TRUE(WriteLinkMessage(&unpaced, message, absl::Seconds(5)));
  EXPECT_EQ(unpaced.frames.size(), kTimedMessageFrames);  // 25,000 bytes each, back to back

  RecordingTransport transport;
  CountingPacer pacer;
  ASSERT_TRUE(WriteLinkMessage(&transport, message, absl::Seconds(5), &pacer));
  ASSERT_EQ(transport.frames.size(), 20u);  // the pacer's 10,000-byte parts
  uint64_t total = 0;
  for (size_t i = 0; i < transport.frames.size(); ++i) {
    EXPECT_LE(transport.frames[i].size, 10000u);
    EXPECT_EQ(pacer.reserved[i], transport.frames[i].size) << "every frame waits its turn";
    total += transport.frames[i].size;
  }
  EXPECT_EQ(total, 200000u);
  EXPECT_TRUE(transport.frames.back().last);
}

TEST(WriteLinkMessageTest, AnEndedLinkStopsWaitingForItsPace) {
  class SlowPacer : public SendPacer {
   public:
    size_t PartBytes() const override { return 1000; }
    absl::Duration Reserve(uint64_t) override { return absl::Hours(1); }
  } pacer;
  auto message = std::make_shared<LinkMessage>();
  message->payload.assign(5000, 'x');
  RecordingTransport transport;
  absl::Notification stop;
  stop.Notify();
  EXPECT_FALSE(WriteLinkMessage(&transport, message, absl::Seconds(5), &pacer, &stop));
  EXPECT_TRUE(transport.frames.empty());
}

}  // namespace
}  // namespace geotrain
