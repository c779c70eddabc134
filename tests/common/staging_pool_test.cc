#include "common/staging_pool.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/tensor_wire.h"

namespace geotrain {
namespace {

HostStagingPool::Options Unpinned(size_t max_cached_bytes = size_t{64} << 20) {
  HostStagingPool::Options options;
  options.pinned = false;
  options.max_cached_bytes = max_cached_bytes;
  return options;
}

// A GPU's tensors reach the wire through the pool; on the CPU the same
// path must give exactly the bytes of encoding the tensor in place.
TEST(StagingPoolTest, StagedMessagesAreBitIdentical) {
  HostStagingPool pool(Unpinned());
  torch::manual_seed(3);
  const std::vector<torch::Tensor> tensors = {
      torch::randn({16, 64, 128}), torch::randn({7}), torch::empty({0}),
      torch::randint(0, 256, {16, 64}, torch::kInt64), torch::randn({5, 3}).t()};
  for (v1::Codec codec : {v1::CODEC_NONE, v1::CODEC_FP16, v1::CODEC_BF16, v1::CODEC_INT8,
                          v1::CODEC_INT4, v1::CODEC_TOPK}) {
    for (bool zstd : {false, true}) {
      WireEncoding encoding;
      encoding.codec = codec;
      encoding.zstd = zstd;
      for (const torch::Tensor& t : tensors) {
        v1::TensorHeader direct_header, staged_header;
        std::string direct, staged;
        ASSERT_TRUE(EncodeTensor(t, &direct_header, &direct, encoding).ok());
        ASSERT_TRUE(EncodeTensor(t, &staged_header, &staged, encoding, &pool).ok());
        EXPECT_EQ(staged_header.SerializeAsString(), direct_header.SerializeAsString());
        EXPECT_EQ(staged, direct) << v1::Codec_Name(codec) << " zstd " << zstd;
      }
    }
  }
}

TEST(StagingPoolTest, SteadyTrafficReusesBuffers) {
  HostStagingPool pool(Unpinned());
  for (int i = 0; i < 100; ++i) {
    HostStagingPool::Lease a = pool.Acquire(1 << 20);
    HostStagingPool::Lease b = pool.Acquire(1000 + i);  // sizes that vary a little
    EXPECT_EQ(a.size(), size_t{1} << 20);
    EXPECT_NE(a.data(), b.data());
  }
  const HostStagingPool::Stats stats = pool.stats();
  EXPECT_EQ(stats.leases, 200);
  EXPECT_EQ(stats.allocations, 2);
}

TEST(StagingPoolTest, IdleBuffersBeyondTheCapAreFreed) {
  HostStagingPool pool(Unpinned(/*max_cached_bytes=*/1 << 20));
  {
    HostStagingPool::Lease a = pool.Acquire(800 << 10);
    HostStagingPool::Lease b = pool.Acquire(800 << 10);
  }
  EXPECT_LE(pool.stats().cached_bytes, size_t{1} << 20);
  EXPECT_GT(pool.stats().cached_bytes, 0u);
}

TEST(StagingPoolTest, CopiesATensorsBytes) {
  HostStagingPool pool(Unpinned());
  const torch::Tensor t = torch::arange(10, torch::kInt64);
  auto lease = pool.CopyToHost(t);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->size(), 80u);
  EXPECT_TRUE(torch::equal(lease->tensor().view(torch::kInt64), t));
  // No GPU in a CPU build: a clear error, not a crash.
  if (!torch::cuda::is_available()) EXPECT_FALSE(pool.CopyToDevice("abc", 0).ok());
}

}  // namespace
}  // namespace geotrain
