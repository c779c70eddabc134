// One parameterised suite over every codec: round-trip error within each
// codec's stated bound on awkward sizes, the NaN/Inf policy, zstd, and
// malformed payloads (truncated, padded, corrupted, huge counts) that must
// give INVALID_ARGUMENT, never a crash.
#include "common/codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

namespace geotrain {
namespace {

struct CodecCase {
  const char* name;
  v1::Codec id;
  double topk_fraction = 0.25;
};

std::vector<float> RandomValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0, 3);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

class CodecTest : public testing::TestWithParam<std::tuple<CodecCase, size_t>> {
 protected:
  std::unique_ptr<Codec> Make() {
    CodecOptions options;
    options.topk_fraction = std::get<0>(GetParam()).topk_fraction;
    auto codec = MakeCodec(std::get<0>(GetParam()).id, options);
    EXPECT_TRUE(codec.ok()) << codec.status();
    return std::move(*codec);
  }
  v1::Codec id() const { return std::get<0>(GetParam()).id; }
  size_t n() const { return std::get<1>(GetParam()); }
};

TEST_P(CodecTest, RoundTripWithinStatedBound) {
  auto codec = Make();
  const std::vector<float> values = RandomValues(n(), 7);
  std::string encoded;
  ASSERT_TRUE(codec->Encode(values.data(), n(), &encoded).ok());
  std::vector<float> decoded(n(), -1.0f);
  ASSERT_TRUE(codec->Decode(encoded, n(), decoded.data()).ok());
  constexpr size_t kBlock = 64;
  size_t kept = 0;
  for (size_t i = 0; i < n(); ++i) {
    const float v = values[i], d = decoded[i];
    float absmax = 0;
    for (size_t j = i / kBlock * kBlock; j < std::min(n(), (i / kBlock + 1) * kBlock); ++j) {
      absmax = std::max(absmax, std::fabs(values[j]));
    }
    switch (id()) {
      case v1::CODEC_NONE:
        ASSERT_EQ(d, v);
        break;
      case v1::CODEC_FP16:
        ASSERT_LE(std::fabs(d - v), 1e-3 * std::fabs(v)) << i;
        break;
      case v1::CODEC_BF16:
        ASSERT_LE(std::fabs(d - v), std::ldexp(1.0, -8) * std::fabs(v)) << i;
        break;
      case v1::CODEC_INT8:
        ASSERT_LE(std::fabs(d - v), absmax / 127 * 1.0001) << i;
        break;
      case v1::CODEC_INT4:
        ASSERT_LE(std::fabs(d - v), absmax / 7 * 1.0001) << i;
        break;
      case v1::CODEC_TOPK:
        ASSERT_TRUE(d == v || d == 0) << i;
        kept += d == v && v != 0;
        break;
      default:
        FAIL();
    }
  }
  if (id() == v1::CODEC_TOPK) {
    const size_t k = static_cast<size_t>(std::ceil(std::get<0>(GetParam()).topk_fraction * n()));
    EXPECT_EQ(kept, std::min(k, n()));
    // What was kept is the largest by magnitude.
    float smallest_kept = std::numeric_limits<float>::infinity(), largest_dropped = 0;
    for (size_t i = 0; i < n(); ++i) {
      if (decoded[i] != 0) smallest_kept = std::min(smallest_kept, std::fabs(values[i]));
      if (decoded[i] == 0) largest_dropped = std::max(largest_dropped, std::fabs(values[i]));
    }
    EXPECT_GE(smallest_kept, largest_dropped);
  }
}

TEST_P(CodecTest, ZstdRoundTrip) {
  auto codec = Make();
  const std::vector<float> values = RandomValues(n(), 9);
  std::string encoded, compressed;
  ASSERT_TRUE(codec->Encode(values.data(), n(), &encoded).ok());
  ASSERT_TRUE(ZstdCompress(encoded, 3, &compressed).ok());
  auto back = ZstdDecompress(compressed, encoded.size());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, encoded);
  if (!encoded.empty()) {
    EXPECT_FALSE(ZstdDecompress(compressed, encoded.size() - 1).ok()) << "larger than announced";
  }
}

TEST_P(CodecTest, NonFiniteInputIsRefused) {
  if (n() == 0) return;
  auto codec = Make();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> values = RandomValues(n(), 3);
    values[n() / 2] = bad;
    std::string encoded;
    EXPECT_EQ(codec->Encode(values.data(), n(), &encoded).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST_P(CodecTest, MalformedPayloadsAreRefused) {
  auto codec = Make();
  const std::vector<float> values = RandomValues(n(), 5);
  std::string encoded;
  ASSERT_TRUE(codec->Encode(values.data(), n(), &encoded).ok());
  std::vector<float> out(n() + 1);
  // One byte too many, one too few.
  EXPECT_EQ(codec->Decode(encoded + "x", n(), out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  if (!encoded.empty()) {
    EXPECT_EQ(codec->Decode(encoded.substr(0, encoded.size() - 1), n(), out.data()).code(),
              absl::StatusCode::kInvalidArgument);
  }
  // A huge element count is refused before any write (out is too small).
  EXPECT_EQ(codec->Decode(encoded, size_t{1} << 40, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  // Random corruption: each result is a decode or INVALID_ARGUMENT.
  std::mt19937 rng(static_cast<uint32_t>(n()) + 17);
  for (int trial = 0; trial < 300 && !encoded.empty(); ++trial) {
    std::string corrupted = encoded;
    for (int flips = 1 + rng() % 4; flips > 0; --flips) {
      corrupted[rng() % corrupted.size()] = static_cast<char>(rng());
    }
    if (rng() % 3 == 0) corrupted.resize(rng() % (corrupted.size() + 1));
    const absl::Status status = codec->Decode(corrupted, n(), out.data());
    if (!status.ok()) EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllCodecs, CodecTest,
    testing::Combine(testing::Values(CodecCase{"none", v1::CODEC_NONE},
                                     CodecCase{"fp16", v1::CODEC_FP16},
                                     CodecCase{"bf16", v1::CODEC_BF16},
                                     CodecCase{"int8", v1::CODEC_INT8},
                                     CodecCase{"int4", v1::CODEC_INT4},
                                     CodecCase{"topk", v1::CODEC_TOPK, 0.25}),
                     testing::Values(size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65},
                                     size_t{1000})),
    [](const testing::TestParamInfo<std::tuple<CodecCase, size_t>>& info) {
      return std::string(std::get<0>(info.param).name) + "_" +
             std::to_string(std::get<1>(info.param));
    });

TEST(CodecFactoryTest, UnknownCodecsAndOptionsAreRefused) {
  EXPECT_FALSE(MakeCodec(v1::CODEC_UNSPECIFIED).ok());
  EXPECT_FALSE(MakeCodec(static_cast<v1::Codec>(99)).ok());
  CodecOptions bad_block;
  bad_block.block_size = 0;
  EXPECT_FALSE(MakeCodec(v1::CODEC_INT8, bad_block).ok());
  CodecOptions bad_fraction;
  bad_fraction.topk_fraction = 0;
  EXPECT_FALSE(MakeCodec(v1::CODEC_TOPK, bad_fraction).ok());
  EXPECT_EQ(*ParseCodecName("int4"), v1::CODEC_INT4);
  EXPECT_FALSE(ParseCodecName("int3").ok());
}

TEST(CodecFactoryTest, Fp16SaturatesOutOfRange) {
  auto codec = *MakeCodec(v1::CODEC_FP16);
  const float values[2] = {1e6f, -1e6f};
  std::string encoded;
  ASSERT_TRUE(codec->Encode(values, 2, &encoded).ok());
  float out[2];
  ASSERT_TRUE(codec->Decode(encoded, 2, out).ok());
  EXPECT_EQ(out[0], 65504.0f);
  EXPECT_EQ(out[1], -65504.0f);
}

// Sending the same tensor again and again, error feedback delivers what an
// earlier round left out: the mean of what arrived converges to the tensor,
// while plain top-k keeps losing the small entries.
TEST(CodecFactoryTest, TopKErrorFeedbackConverges) {
  const std::vector<float> v = RandomValues(100, 21);
  for (bool feedback : {false, true}) {
    CodecOptions options;
    options.topk_fraction = 0.1;
    options.error_feedback = feedback;
    auto codec = *MakeCodec(v1::CODEC_TOPK, options);
    std::vector<double> sum(v.size(), 0);
    constexpr int kRounds = 200;
    for (int round = 0; round < kRounds; ++round) {
      std::string encoded;
      ASSERT_TRUE(codec->Encode(v.data(), v.size(), &encoded).ok());
      std::vector<float> out(v.size());
      ASSERT_TRUE(codec->Decode(encoded, v.size(), out.data()).ok());
      for (size_t i = 0; i < v.size(); ++i) sum[i] += out[i];
    }
    double worst = 0, largest = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      worst = std::max(worst, std::fabs(sum[i] / kRounds - v[i]));
      largest = std::max(largest, static_cast<double>(std::fabs(v[i])));
    }
    if (feedback) {
      EXPECT_LT(worst / largest, 0.1);
    } else {
      EXPECT_GT(worst / largest, 0.3) << "entries never sent stay missing";
    }
  }
}

}  // namespace
}  // namespace geotrain
