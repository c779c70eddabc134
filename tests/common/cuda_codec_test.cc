// The CUDA int8/int4 kernels against the CPU codecs: the same bytes on the
// wire and the same decoded values. Skips where no GPU is visible.
#include <cuda_runtime.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/codec.h"
#include "common/staging_pool.h"
#include "common/cuda/block_codec_cuda.h"
#include "common/tensor_wire.h"
#include "gtest/gtest.h"

namespace geotrain {
namespace {

struct Case {
  int bits;
  size_t n;
  int block;
};

class CudaBlockCodecTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (cuda::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  }
};

template <typename T>
T* DeviceCopy(const T* host, size_t count) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, std::max<size_t>(1, count) * sizeof(T)), cudaSuccess);
  if (count) cudaMemcpy(device, host, count * sizeof(T), cudaMemcpyHostToDevice);
  return device;
}

TEST_P(CudaBlockCodecTest, SameBytesAndValuesAsTheCpu) {
  const Case c = GetParam();
  std::mt19937 rng(c.n * 31 + c.bits);
  std::normal_distribution<float> normal(0, 3);
  std::vector<float> values(c.n);
  for (float& v : values) v = normal(rng);

  CodecOptions options;
  options.block_size = c.block;
  auto cpu = MakeCodec(c.bits == 8 ? v1::CODEC_INT8 : v1::CODEC_INT4, options);
  ASSERT_TRUE(cpu.ok());
  std::string expected;
  ASSERT_TRUE((*cpu)->Encode(values.data(), c.n, &expected).ok());
  const size_t size = cuda::BlockEncodedSize(c.n, c.block, c.bits);
  ASSERT_EQ(size, expected.size());

  float* d_values = DeviceCopy(values.data(), c.n);
  char* d_encoded = nullptr;
  int* d_flag = nullptr;
  ASSERT_EQ(cudaMalloc(&d_encoded, std::max<size_t>(1, size)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_flag, sizeof(int)), cudaSuccess);
  cudaMemset(d_flag, 0, sizeof(int));
  ASSERT_EQ(cuda::EncodeBlocksOnDevice(d_values, c.n, c.block, c.bits, d_encoded, d_flag, nullptr), "");
  std::string encoded(size, '\0');
  int flag = -1;
  cudaMemcpy(encoded.data(), d_encoded, size, cudaMemcpyDeviceToHost);
  cudaMemcpy(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT_EQ(flag, 0);
  EXPECT_EQ(encoded, expected);

  std::vector<float> want(c.n), got(c.n);
  ASSERT_TRUE((*cpu)->Decode(expected, c.n, want.data()).ok());
  float* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_out, std::max<size_t>(1, c.n) * sizeof(float)), cudaSuccess);
  cudaMemset(d_flag, 0, sizeof(int));
  ASSERT_EQ(cuda::DecodeBlocksOnDevice(d_encoded, c.n, c.block, c.bits, d_out, d_flag, nullptr), "");
  if (c.n) cudaMemcpy(got.data(), d_out, c.n * sizeof(float), cudaMemcpyDeviceToHost);
  cudaMemcpy(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT_EQ(flag, 0);
  EXPECT_EQ(got, want);
  cudaFree(d_values);
  cudaFree(d_encoded);
  cudaFree(d_flag);
  cudaFree(d_out);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaBlockCodecTest,
                         ::testing::Values(Case{8, 0, 64}, Case{8, 1, 64}, Case{8, 63, 64},
                                           Case{8, 65, 64}, Case{8, 100000, 64},
                                           Case{8, 1000, 7}, Case{4, 1, 64}, Case{4, 65, 64},
                                           Case{4, 100001, 64}, Case{4, 999, 33}));

TEST(CudaBlockCodecFlagsTest, NonFiniteInputAndBadScalesAreFlagged) {
  if (cuda::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  std::vector<float> values(130, 1.0f);
  values[100] = std::nanf("");
  float* d_values = DeviceCopy(values.data(), values.size());
  const size_t size = cuda::BlockEncodedSize(values.size(), 64, 8);
  char* d_encoded = nullptr;
  int* d_flag = nullptr;
  cudaMalloc(&d_encoded, size);
  cudaMalloc(&d_flag, sizeof(int));
  cudaMemset(d_flag, 0, sizeof(int));
  ASSERT_EQ(cuda::EncodeBlocksOnDevice(d_values, values.size(), 64, 8, d_encoded, d_flag, nullptr), "");
  int flag = 0;
  cudaMemcpy(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT_EQ(flag, 1);
  // A negative scale in the second block.
  const float negative = -1.0f;
  cudaMemcpy(d_encoded + 68, &negative, sizeof(float), cudaMemcpyHostToDevice);
  float* d_out = nullptr;
  cudaMalloc(&d_out, values.size() * sizeof(float));
  cudaMemset(d_flag, 0, sizeof(int));
  ASSERT_EQ(cuda::DecodeBlocksOnDevice(d_encoded, values.size(), 64, 8, d_out, d_flag, nullptr), "");
  cudaMemcpy(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT_EQ(flag, 1);
  cudaFree(d_values);
  cudaFree(d_encoded);
  cudaFree(d_flag);
  cudaFree(d_out);
}

// Through the tensor wire format, which is what the worker uses.
TEST(CudaTensorWireTest, DeviceAndHostEncodingsAgree) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "LibTorch sees no CUDA device";
  torch::manual_seed(1);
  const torch::Tensor host = torch::randn({16, 64, 128});
  for (v1::Codec codec : {v1::CODEC_INT8, v1::CODEC_INT4}) {
    WireEncoding encoding;
    encoding.codec = codec;
    v1::TensorHeader from_host, from_device;
    std::string host_payload, device_payload;
    ASSERT_TRUE(EncodeTensor(host, &from_host, &host_payload, encoding).ok());
    ASSERT_TRUE(EncodeTensor(host.to(torch::kCUDA), &from_device, &device_payload, encoding).ok());
    EXPECT_EQ(device_payload, host_payload);
    auto on_device = DecodeTensor(from_device, device_payload, 0, /*cuda_device=*/0);
    auto on_host = DecodeTensor(from_host, host_payload, 0);
    ASSERT_TRUE(on_device.ok() && on_host.ok());
    EXPECT_TRUE(on_device->is_cuda());
    EXPECT_TRUE(torch::equal(on_device->cpu(), *on_host));
  }
  v1::TensorHeader header;
  std::string payload;
  WireEncoding int8;
  int8.codec = v1::CODEC_INT8;
  EXPECT_FALSE(EncodeTensor(torch::full({10}, NAN).to(torch::kCUDA), &header, &payload, int8).ok());
}

// The kernels follow the caller's current stream and device, as LibTorch's
// own do: a side stream, and cuda:1 where there is one.
TEST(CudaTensorWireTest, KernelsRunOnTheCurrentStreamAndDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "LibTorch sees no CUDA device";
  torch::manual_seed(2);
  const torch::Tensor host = torch::randn({4096});
  WireEncoding int8;
  int8.codec = v1::CODEC_INT8;
  v1::TensorHeader expected_header;
  std::string expected;
  ASSERT_TRUE(EncodeTensor(host, &expected_header, &expected, int8).ok());
  const int devices = static_cast<int>(torch::cuda::device_count());
  for (int device = 0; device < std::min(devices, 2); ++device) {
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device);
    const c10::cuda::CUDAStreamGuard on_side(side);
    const torch::Tensor values = host.to(torch::Device(torch::kCUDA, device));
    v1::TensorHeader header;
    std::string payload;
    ASSERT_TRUE(EncodeTensor(values, &header, &payload, int8).ok()) << "cuda:" << device;
    EXPECT_EQ(payload, expected) << "cuda:" << device;
    DeferredDeviceChecks checks;
    auto decoded = DecodeTensor(header, payload, 0, device, &checks);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->device().index(), device);
    EXPECT_TRUE(checks.SynchronizeAndVerify().ok());
    auto reference = DecodeTensor(expected_header, expected, 0);
    EXPECT_TRUE(torch::equal(decoded->cpu(), *reference));
  }
}

// A bad block scale is found without a synchronisation of its own: the flag
// is read once the stream has been synchronised anyway.
TEST(CudaTensorWireTest, BadScalesAreCaughtByTheDeferredCheck) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "LibTorch sees no CUDA device";
  WireEncoding int8;
  int8.codec = v1::CODEC_INT8;
  v1::TensorHeader header;
  std::string payload;
  ASSERT_TRUE(EncodeTensor(torch::randn({256}), &header, &payload, int8).ok());
  const float bad = -1.0f;
  std::memcpy(&payload[0], &bad, sizeof(bad));  // the first block's scale
  DeferredDeviceChecks checks;
  auto decoded = DecodeTensor(header, payload, 0, 0, &checks);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_FALSE(checks.empty());
  EXPECT_EQ(checks.SynchronizeAndVerify().code(), absl::StatusCode::kInvalidArgument);
  // Without a deferred list the check happens at once.
  EXPECT_EQ(DecodeTensor(header, payload, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A scale so large that values overflow is refused too.
  const float huge = 3e38f;
  std::memcpy(&payload[0], &huge, sizeof(huge));
  EXPECT_EQ(DecodeTensor(header, payload, 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudaStagingPoolTest, PinnedRoundTripReusesBuffers) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "LibTorch sees no CUDA device";
  HostStagingPool::Options options;
  options.pinned = true;
  HostStagingPool pool(options);
  const std::string bytes(300000, 'x');
  for (int i = 0; i < 20; ++i) {
    auto device = pool.CopyToDevice(bytes, 0);
    ASSERT_TRUE(device.ok()) << device.status();
    auto host = pool.CopyToHost(*device);
    ASSERT_TRUE(host.ok()) << host.status();
    ASSERT_EQ(std::string(host->data(), host->size()), bytes);
  }
  EXPECT_LE(pool.stats().allocations, 4);  // the rest reused
}

}  // namespace
}  // namespace geotrain
