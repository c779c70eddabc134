#include "common/tensor_wire.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace geotrain {
namespace {

class TensorRoundTripTest : public testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(TensorRoundTripTest, Float32IsExact) {
  torch::Tensor t = torch::randn(GetParam());
  v1::TensorHeader header;
  std::string payload = "prefix";
  ASSERT_TRUE(EncodeTensor(t, &header, &payload).ok());
  EXPECT_EQ(header.dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(header.payload_bytes(), static_cast<uint64_t>(t.numel() * 4));
  absl::StatusOr<torch::Tensor> back = DecodeTensor(header, payload, 6);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->sizes().equals(t.sizes()));
  EXPECT_TRUE(torch::equal(*back, t));
}

INSTANTIATE_TEST_SUITE_P(Shapes, TensorRoundTripTest,
                         testing::Values(std::vector<int64_t>{0}, std::vector<int64_t>{1},
                                         std::vector<int64_t>{3, 5},
                                         std::vector<int64_t>{2, 64, 128},
                                         std::vector<int64_t>{1000, 3}));

TEST(TensorWireTest, Int64RoundTrip) {
  torch::Tensor t = torch::randint(0, 256, {4, 9}, torch::kInt64);
  v1::TensorHeader header;
  std::string payload;
  ASSERT_TRUE(EncodeTensor(t, &header, &payload).ok());
  absl::StatusOr<torch::Tensor> back = DecodeTensor(header, payload, 0);
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(torch::equal(*back, t));
}

TEST(TensorWireTest, NonContiguousIsEncodedInLogicalOrder) {
  torch::Tensor t = torch::arange(12, torch::kFloat32).reshape({3, 4}).t();
  v1::TensorHeader header;
  std::string payload;
  ASSERT_TRUE(EncodeTensor(t, &header, &payload).ok());
  EXPECT_TRUE(torch::equal(*DecodeTensor(header, payload, 0), t));
}

TEST(TensorWireTest, RefusesPayloadTooShort) {
  torch::Tensor t = torch::ones({10});
  v1::TensorHeader header;
  std::string payload;
  ASSERT_TRUE(EncodeTensor(t, &header, &payload).ok());
  payload.resize(payload.size() - 1);
  EXPECT_EQ(DecodeTensor(header, payload, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeTensor(header, payload, 1000).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TensorWireTest, RefusesInconsistentHeader) {
  v1::TensorHeader header;
  header.add_shape(4);
  header.set_dtype(v1::DTYPE_FLOAT32);
  header.set_codec(v1::CODEC_NONE);
  header.set_payload_bytes(12);  // 4 floats need 16
  EXPECT_EQ(DecodeTensor(header, std::string(16, '\0'), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  header.set_payload_bytes(16);
  header.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(DecodeTensor(header, std::string(16, '\0'), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

class EncodedTensorTest : public testing::TestWithParam<std::tuple<v1::Codec, bool>> {};

TEST_P(EncodedTensorTest, RoundTripThroughTheWire) {
  WireEncoding encoding;
  encoding.codec = std::get<0>(GetParam());
  encoding.zstd = std::get<1>(GetParam());
  encoding.topk_fraction = 0.5;
  torch::manual_seed(4);
  torch::Tensor t = torch::randn({3, 70});
  v1::TensorHeader header;
  std::string payload;
  ASSERT_TRUE(EncodeTensor(t, &header, &payload, encoding).ok());
  EXPECT_EQ(header.codec(), encoding.codec);
  EXPECT_EQ(header.zstd(), encoding.zstd);
  EXPECT_EQ(header.payload_bytes(), payload.size());
  absl::StatusOr<torch::Tensor> back = DecodeTensor(header, payload, 0);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->sizes().equals(t.sizes()));
  const double error = (*back - t).abs().max().item<double>();
  EXPECT_LE(error, encoding.codec == v1::CODEC_TOPK ? t.abs().max().item<double>() : 0.7);
  // A truncated payload is refused.
  payload.resize(payload.size() - 1);
  EXPECT_EQ(DecodeTensor(header, payload, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Codecs, EncodedTensorTest,
                         testing::Combine(testing::Values(v1::CODEC_NONE, v1::CODEC_FP16,
                                                          v1::CODEC_BF16, v1::CODEC_INT8,
                                                          v1::CODEC_INT4, v1::CODEC_TOPK),
                                          testing::Bool()));

TEST(TensorWireTest, Int64TargetsCanBeZstdCompressed) {
  torch::Tensor t = torch::randint(0, 256, {16, 64}, torch::kInt64);
  WireEncoding encoding;
  encoding.zstd = true;
  encoding.codec = v1::CODEC_INT8;  // applies to float32 only
  v1::TensorHeader header;
  std::string payload;
  ASSERT_TRUE(EncodeTensor(t, &header, &payload, encoding).ok());
  EXPECT_EQ(header.codec(), v1::CODEC_NONE);
  EXPECT_LT(payload.size(), 16u * 64 * 8 / 3);
  EXPECT_TRUE(torch::equal(*DecodeTensor(header, payload, 0), t));
}

TEST(TensorWireTest, DecodedNonFiniteValuesAreRefused) {
  // An fp16 payload can carry NaN bit patterns; the decoder refuses them.
  v1::TensorHeader header;
  header.add_shape(2);
  header.set_dtype(v1::DTYPE_FLOAT32);
  header.set_codec(v1::CODEC_FP16);
  header.set_encoded_bytes(4);
  header.set_payload_bytes(4);
  const std::string payload("\x00\x3c\xff\x7f", 4);  // 1.0, NaN
  EXPECT_EQ(DecodeTensor(header, payload, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorWireTest, RefusesUnsupportedDtype) {
  v1::TensorHeader header;
  std::string payload;
  EXPECT_FALSE(EncodeTensor(torch::ones({2}, torch::kInt8), &header, &payload).ok());
}

}  // namespace
}  // namespace geotrain
