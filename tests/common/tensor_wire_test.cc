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

TEST(TensorWireTest, RefusesUnsupportedDtype) {
  v1::TensorHeader header;
  std::string payload;
  EXPECT_FALSE(EncodeTensor(torch::ones({2}, torch::kInt8), &header, &payload).ok());
}

}  // namespace
}  // namespace geotrain
