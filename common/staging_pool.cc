#include "common/staging_pool.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"

#ifdef GEOTRAIN_TORCH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace geotrain {

struct HostStagingPool::Lease::Buffer {
  at::Tensor storage;  // uint8, capacity bytes
  size_t capacity = 0;
#ifdef GEOTRAIN_TORCH_CUDA
  // Set while an asynchronous copy may still read the buffer.
  std::unique_ptr<at::cuda::CUDAEvent> in_use_until;
  bool busy() const { return in_use_until != nullptr && !in_use_until->query(); }
#else
  bool busy() const { return false; }
#endif
};

namespace {

#ifdef GEOTRAIN_TORCH_CUDA
// One copy stream per device, so copies do not queue behind compute.
c10::cuda::CUDAStream CopyStream(c10::DeviceIndex device) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* streams = new std::map<c10::DeviceIndex, c10::cuda::CUDAStream>();
  absl::MutexLock lock(&mu);
  auto it = streams->find(device);
  if (it == streams->end()) {
    it = streams->emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device))
             .first;
  }
  return it->second;
}
#endif

}  // namespace

HostStagingPool::Lease::Lease(HostStagingPool* pool, std::unique_ptr<Buffer> buffer, size_t size)
    : pool_(pool), buffer_(std::move(buffer)), size_(size) {}
HostStagingPool::Lease::Lease(Lease&&) noexcept = default;
HostStagingPool::Lease& HostStagingPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    if (buffer_ != nullptr) pool_->Return(std::move(buffer_));
    pool_ = other.pool_;
    buffer_ = std::move(other.buffer_);
    size_ = other.size_;
  }
  return *this;
}
HostStagingPool::Lease::~Lease() {
  if (buffer_ != nullptr) pool_->Return(std::move(buffer_));
}
char* HostStagingPool::Lease::data() const {
  return static_cast<char*>(buffer_->storage.data_ptr());
}
size_t HostStagingPool::Lease::size() const { return size_; }
at::Tensor HostStagingPool::Lease::tensor() const {
  return buffer_->storage.narrow(0, 0, static_cast<int64_t>(size_));
}

HostStagingPool& HostStagingPool::Shared() {
  static HostStagingPool* pool = [] {
    Options options;
    options.pinned = torch::cuda::is_available();
    return new HostStagingPool(options);
  }();
  return *pool;
}

HostStagingPool::HostStagingPool(Options options) : options_(options) {}
HostStagingPool::~HostStagingPool() = default;

HostStagingPool::Lease HostStagingPool::Acquire(size_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    ++stats_.leases;
    // The smallest idle buffer that fits and that no copy still reads.
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if ((*it)->capacity >= bytes && !(*it)->busy() &&
          (best == idle_.end() || (*it)->capacity < (*best)->capacity)) {
        best = it;
      }
    }
    if (best != idle_.end()) {
      std::unique_ptr<Lease::Buffer> buffer = std::move(*best);
      idle_.erase(best);
      stats_.cached_bytes -= buffer->capacity;
      return Lease(this, std::move(buffer), bytes);
    }
    ++stats_.allocations;
  }
  auto buffer = std::make_unique<Lease::Buffer>();
  // Rounded up to 64 KiB, so that sizes that vary a little share buffers.
  buffer->capacity = std::max<size_t>(1, (bytes + 65535) / 65536 * 65536);
  buffer->storage = torch::empty({static_cast<int64_t>(buffer->capacity)},
                                 torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(
                                     options_.pinned));
  return Lease(this, std::move(buffer), bytes);
}

void HostStagingPool::Return(std::unique_ptr<Lease::Buffer> buffer) {
  absl::MutexLock lock(&mu_);
  stats_.cached_bytes += buffer->capacity;
  idle_.push_back(std::move(buffer));
  // Over the cap: free the largest idle buffers that no copy reads.
  while (stats_.cached_bytes > options_.max_cached_bytes) {
    auto largest = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if (!(*it)->busy() && (largest == idle_.end() || (*it)->capacity > (*largest)->capacity)) {
        largest = it;
      }
    }
    if (largest == idle_.end()) break;
    stats_.cached_bytes -= (*largest)->capacity;
    idle_.erase(largest);
  }
}

HostStagingPool::Stats HostStagingPool::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

absl::StatusOr<HostStagingPool::Lease> HostStagingPool::CopyToHost(const at::Tensor& tensor) {
  try {
    const torch::Tensor values = tensor.detach().contiguous();
    const size_t bytes = static_cast<size_t>(values.numel()) * values.element_size();
    Lease lease = Acquire(bytes);
    if (bytes == 0) return lease;
    if (!values.is_cuda()) {
      std::memcpy(lease.data(), values.data_ptr(), bytes);
      return lease;
    }
#ifdef GEOTRAIN_TORCH_CUDA
    const c10::cuda::CUDAGuard guard(values.device());
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(values.device().index());
    const c10::cuda::CUDAStream copy = CopyStream(values.device().index());
    at::cuda::CUDAEvent produced;
    produced.record(compute);
    produced.block(copy);
    {
      const c10::cuda::CUDAStreamGuard on_copy(copy);
      lease.tensor().copy_(values.view({-1}).view(torch::kUInt8), /*non_blocking=*/true);
    }
    copy.synchronize();  // the copy alone; compute may run on
    return lease;
#else
    return absl::FailedPreconditionError("a CUDA tensor in a build without CUDA LibTorch");
#endif
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("copy to host: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<at::Tensor> HostStagingPool::CopyToDevice(absl::string_view bytes, int device) {
#ifdef GEOTRAIN_TORCH_CUDA
  try {
    const c10::Device target(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
    const c10::cuda::CUDAGuard guard(target);
    torch::Tensor out = torch::empty({static_cast<int64_t>(bytes.size())},
                                     torch::TensorOptions().dtype(torch::kUInt8).device(target));
    if (bytes.empty()) return out;
    Lease lease = Acquire(bytes.size());
    std::memcpy(lease.data(), bytes.data(), bytes.size());
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(target.index());
    const c10::cuda::CUDAStream copy = CopyStream(target.index());
    // `out` was allocated on the compute stream, which may still use its
    // previous contents: the copy waits for that.
    at::cuda::CUDAEvent free_to_write;
    free_to_write.record(compute);
    free_to_write.block(copy);
    {
      const c10::cuda::CUDAStreamGuard on_copy(copy);
      out.copy_(lease.tensor(), /*non_blocking=*/true);
    }
    auto copied = std::make_unique<at::cuda::CUDAEvent>();
    copied->record(copy);
    copied->block(compute);
    lease.buffer_->in_use_until = std::move(copied);  // reused once the copy is done
    return out;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("copy to cuda:", device, ": ",
                                            e.what_without_backtrace()));
  }
#else
  (void)bytes;
  return absl::FailedPreconditionError(
      absl::StrCat("cuda:", device, " in a build without CUDA LibTorch"));
#endif
}

}  // namespace geotrain
