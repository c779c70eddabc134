// Host buffers for tensors that cross between a GPU and the wire, and the
// copies through them.
//
// A GPU worker's activations and gradients leave and enter the device
// through page-locked (pinned) host buffers, so the copies can be
// asynchronous: a device-to-host copy runs on a per-device copy stream
// after an event on the compute stream, and the caller waits for that copy
// alone; a host-to-device copy is issued on the copy stream and the compute
// stream waits for it with an event, never the host. Buffers are reused by
// size, so steady-state training allocates none; a buffer whose copy may
// still be running is not handed out again until its event has fired.
//
// Without CUDA the same code runs with ordinary host memory and plain
// copies (tests use it to check that staged messages are bit-identical).
// Thread-safe. This header does not include LibTorch.
#ifndef GEOTRAIN_COMMON_STAGING_POOL_H_
#define GEOTRAIN_COMMON_STAGING_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace at {
class Tensor;
}  // namespace at

namespace geotrain {

class HostStagingPool {
 public:
  struct Options {
    bool pinned = false;                          // page-locked buffers (needs CUDA)
    size_t max_cached_bytes = size_t{256} << 20;  // idle buffers kept beyond this are freed
  };
  // The process's pool: pinned when LibTorch sees a CUDA device.
  static HostStagingPool& Shared();

  explicit HostStagingPool(Options options);
  ~HostStagingPool();

  // A host buffer of at least `bytes`, back in the pool when the lease ends.
  class Lease {
   public:
    Lease(Lease&&) noexcept;
    Lease& operator=(Lease&&) noexcept;
    ~Lease();
    char* data() const;
    size_t size() const;  // as asked for
    // The buffer's first size() bytes as a uint8 CPU tensor (no copy).
    at::Tensor tensor() const;

   private:
    friend class HostStagingPool;
    struct Buffer;
    Lease(HostStagingPool* pool, std::unique_ptr<Buffer> buffer, size_t size);
    HostStagingPool* pool_;
    std::unique_ptr<Buffer> buffer_;
    size_t size_;
  };
  Lease Acquire(size_t bytes);

  // The bytes of `tensor` (any device, dtype; made contiguous) in a leased
  // host buffer. From a GPU: copied on the device's copy stream once the
  // compute stream has produced them; returns when that copy is done.
  absl::StatusOr<Lease> CopyToHost(const at::Tensor& tensor);

  // `bytes` as a new uint8 tensor on CUDA device `device`, copied through a
  // pinned buffer on the copy stream; the device's current stream waits for
  // the copy (an event), the host does not.
  absl::StatusOr<at::Tensor> CopyToDevice(absl::string_view bytes, int device);

  struct Stats {
    int64_t leases = 0;       // Acquire calls
    int64_t allocations = 0;  // buffers allocated (the rest were reused)
    size_t cached_bytes = 0;  // idle buffers held now
  };
  Stats stats() const;
  bool pinned() const { return options_.pinned; }

 private:
  void Return(std::unique_ptr<Lease::Buffer> buffer);

  const Options options_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Lease::Buffer>> idle_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_STAGING_POOL_H_
