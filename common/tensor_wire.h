// Tensor <-> wire (TensorHeader + payload bytes). The only common/ unit that
// uses LibTorch; callers that include this header include torch themselves.
#ifndef GEOTRAIN_COMMON_TENSOR_WIRE_H_
#define GEOTRAIN_COMMON_TENSOR_WIRE_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "geotrain/v1/tensor.pb.h"

namespace at {
class Tensor;
}  // namespace at

namespace geotrain {

// How a float32 tensor is put on the wire (see common/codec.h).
struct WireEncoding {
  v1::Codec codec = v1::CODEC_NONE;
  int block_size = 64;
  double topk_fraction = 0.01;
  bool zstd = false;
};

class HostStagingPool;

// Checks of tensors decoded on a GPU (a bad block scale, a non-finite
// value) whose flags come back to the host without a synchronisation of
// their own: each flag is copied into pinned memory on the compute stream
// behind the kernel that sets it, and read once a synchronisation that
// happens anyway (the next device-to-host copy of a message, the loss
// value) has completed. Not thread-safe: one per compute thread.
class DeferredDeviceChecks {
 public:
  DeferredDeviceChecks();
  ~DeferredDeviceChecks();
  DeferredDeviceChecks(const DeferredDeviceChecks&) = delete;
  DeferredDeviceChecks& operator=(const DeferredDeviceChecks&) = delete;

  // `device_flag`: an int32 CUDA tensor that a kernel may set non-zero;
  // `what` names the failure. Enqueues the flag's copy to the host.
  void Add(const at::Tensor& device_flag, const char* what);
  // REQUIRES: the compute stream has been synchronised since the last Add
  // (Synchronize() does it). INVALID_ARGUMENT naming the first failure;
  // either way the flags are forgotten.
  absl::Status Verify();
  // Synchronises the stream the flags were queued on, then Verify().
  absl::Status SynchronizeAndVerify();
  bool empty() const;

 private:
  struct Flag;
  std::vector<Flag> flags_;
};

// Appends `tensor`'s elements to `payload` (contiguous, float32 tensors
// encoded as `encoding` says; other dtypes raw) and describes them in
// `header`. Supports float32, int64, float16 and bfloat16. A tensor on a GPU
// leaves it through `staging` (HostStagingPool::Shared() when null), on the
// device's copy stream; built with GEOTRAIN_WITH_CUDA, int8 and int4 are
// encoded on the device first, so only the encoded bytes cross, and the
// encoder's non-finite flag comes back with them. A CPU tensor is read in
// place, or, with `staging`, through it (the GPU's path; tests use it to
// show that staged messages are bit-identical).
absl::Status EncodeTensor(const at::Tensor& tensor, v1::TensorHeader* header,
                          std::string* payload, const WireEncoding& encoding = {},
                          HostStagingPool* staging = nullptr);

// Decodes the tensor described by `header` from `payload` at `offset` into a
// new tensor: on the CPU, or with `cuda_device` >= 0 on that CUDA device
// (the bytes cross through the shared staging pool on the copy stream;
// int8/int4 are decoded there by the CUDA kernels when built with them, the
// rest decoded on the CPU first). Checks header consistency and bounds
// before reading, and that a decoded float tensor is finite: on the host
// at once, or, for tensors decoded on a GPU, through `device_checks` (with
// none, at once, with a synchronisation).
absl::StatusOr<at::Tensor> DecodeTensor(const v1::TensorHeader& header,
                                        const std::string& payload,
                                        size_t offset, int cuda_device = -1,
                                        DeferredDeviceChecks* device_checks = nullptr);

// Whether this build has the CUDA codec kernels.
bool HasCudaCodecs();

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_TENSOR_WIRE_H_
