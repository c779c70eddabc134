#include "common/link_message.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>

namespace geotrain {
namespace {

LinkMessage MakeMessage(size_t floats) {
  LinkMessage m;
  m.header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  m.header.set_microbatch(7);
  v1::TensorHeader* t = m.header.add_tensors();
  t->add_shape(static_cast<int64_t>(floats));
  t->set_dtype(v1::DTYPE_FLOAT32);
  t->set_codec(v1::CODEC_NONE);
  t->set_payload_bytes(floats * 4);
  m.payload.resize(floats * 4);
  for (size_t i = 0; i < m.payload.size(); ++i) m.payload[i] = static_cast<char>(i * 31);
  return m;
}

class FramingTest : public testing::TestWithParam<size_t> {};

TEST_P(FramingTest, SplitThenAssembleIsIdentity) {
  const LinkMessage original = MakeMessage(GetParam());
  std::vector<v1::LinkFrame> frames = SplitIntoFrames(original, 1000);
  EXPECT_EQ(frames.size(), std::max<size_t>(1, (original.payload.size() + 999) / 1000));
  FrameAssembler assembler;
  std::optional<LinkMessage> out;
  for (size_t i = 0; i < frames.size(); ++i) {
    absl::StatusOr<std::optional<LinkMessage>> added = assembler.Add(frames[i]);
    ASSERT_TRUE(added.ok()) << added.status();
    EXPECT_EQ(added->has_value(), i + 1 == frames.size());
    if (added->has_value()) out = std::move(**added);
  }
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->payload, original.payload);
  EXPECT_EQ(out->header.microbatch(), 7u);
}

INSTANTIATE_TEST_SUITE_P(Sizes, FramingTest, testing::Values(0, 1, 250, 251, 2500, 100000));

TEST(FrameAssemblerTest, RefusesFirstFrameWithoutHeader) {
  FrameAssembler assembler;
  v1::LinkFrame frame;
  frame.set_last(true);
  EXPECT_EQ(assembler.Add(frame).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FrameAssemblerTest, RefusesMoreBytesThanAnnounced) {
  LinkMessage m = MakeMessage(10);
  std::vector<v1::LinkFrame> frames = SplitIntoFrames(m);
  frames[0].mutable_data()->append("extra");
  FrameAssembler assembler;
  EXPECT_EQ(assembler.Add(frames[0]).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FrameAssemblerTest, RefusesFewerBytesThanAnnounced) {
  LinkMessage m = MakeMessage(10);
  std::vector<v1::LinkFrame> frames = SplitIntoFrames(m);
  frames[0].mutable_data()->resize(12);
  FrameAssembler assembler;
  EXPECT_EQ(assembler.Add(frames[0]).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FrameAssemblerTest, RefusesOversizedMessageBeforeBuffering) {
  LinkMessage m = MakeMessage(1);
  m.header.mutable_tensors(0)->set_payload_bytes(uint64_t{1} << 40);
  FrameAssembler assembler(1 << 20);
  absl::StatusOr<std::optional<LinkMessage>> added = assembler.Add(SplitIntoFrames(m)[0]);
  EXPECT_EQ(added.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FrameAssemblerTest, RefusesHeaderInTheMiddle) {
  LinkMessage m = MakeMessage(1000);
  std::vector<v1::LinkFrame> frames = SplitIntoFrames(m, 100);
  *frames[1].mutable_header() = m.header;
  FrameAssembler assembler;
  ASSERT_TRUE(assembler.Add(frames[0]).ok());
  EXPECT_EQ(assembler.Add(frames[1]).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorHeaderTest, ChecksShapeAgainstSpec) {
  TensorSpec spec{{8, 16, 32}, v1::DTYPE_FLOAT32};
  v1::TensorHeader h;
  for (int64_t d : {8, 16, 32}) h.add_shape(d);
  h.set_dtype(v1::DTYPE_FLOAT32);
  h.set_codec(v1::CODEC_NONE);
  h.set_payload_bytes(8 * 16 * 32 * 4);
  EXPECT_TRUE(CheckTensorMatches(h, spec, "x").ok());

  v1::TensorHeader smaller_batch = h;
  smaller_batch.set_shape(0, 3);
  smaller_batch.set_payload_bytes(3 * 16 * 32 * 4);
  EXPECT_TRUE(CheckTensorMatches(smaller_batch, spec, "x").ok());

  v1::TensorHeader wrong_shape = h;
  wrong_shape.set_shape(2, 31);
  wrong_shape.set_payload_bytes(8 * 16 * 31 * 4);
  EXPECT_EQ(CheckTensorMatches(wrong_shape, spec, "x").code(), absl::StatusCode::kInvalidArgument);

  v1::TensorHeader wrong_dtype = h;
  wrong_dtype.set_dtype(v1::DTYPE_INT64);
  wrong_dtype.set_payload_bytes(8 * 16 * 32 * 8);
  EXPECT_EQ(CheckTensorMatches(wrong_dtype, spec, "x").code(), absl::StatusCode::kInvalidArgument);

  v1::TensorHeader wrong_size = h;
  wrong_size.set_payload_bytes(5);
  EXPECT_EQ(CheckTensorMatches(wrong_size, spec, "x").code(), absl::StatusCode::kInvalidArgument);

  v1::TensorHeader huge = h;
  huge.set_shape(1, int64_t{1} << 40);
  EXPECT_EQ(CheckTensorHeader(huge).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorHeaderTest, FindsNonFiniteValues) {
  LinkMessage m = MakeMessage(4);
  const float values[4] = {1.0f, 2.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f};
  std::memcpy(m.payload.data(), values, sizeof(values));
  EXPECT_EQ(CheckFinite(m.header.tensors(0), m.payload, 0).code(),
            absl::StatusCode::kInvalidArgument);
  const float finite[4] = {1.0f, 2.0f, 3.0f, -4.0f};
  std::memcpy(m.payload.data(), finite, sizeof(finite));
  EXPECT_TRUE(CheckFinite(m.header.tensors(0), m.payload, 0).ok());
}

// Random corruption of frames never crashes the assembler: each result is
// a message or an INVALID_ARGUMENT error.
TEST(FrameAssemblerTest, SurvivesRandomCorruption) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 2000; ++trial) {
    LinkMessage m = MakeMessage(1 + rng() % 300);
    std::vector<v1::LinkFrame> frames = SplitIntoFrames(m, 1 + rng() % 500);
    std::string wire;
    frames[0].SerializeToString(&wire);
    for (int flips = 1 + rng() % 8; flips > 0; --flips) {
      wire[rng() % wire.size()] = static_cast<char>(rng());
    }
    v1::LinkFrame corrupted;
    if (!corrupted.ParseFromString(wire)) continue;
    frames[0] = corrupted;
    FrameAssembler assembler(1 << 20);
    for (const v1::LinkFrame& f : frames) {
      absl::StatusOr<std::optional<LinkMessage>> added = assembler.Add(f);
      if (!added.ok()) {
        EXPECT_EQ(added.status().code(), absl::StatusCode::kInvalidArgument);
        break;
      }
    }
  }
}

}  // namespace
}  // namespace geotrain
