// Tensor <-> wire (TensorHeader + payload bytes). The only common/ unit that
// uses LibTorch; callers that include this header include torch themselves.
#ifndef GEOTRAIN_COMMON_TENSOR_WIRE_H_
#define GEOTRAIN_COMMON_TENSOR_WIRE_H_

#include <cstddef>
#include <string>

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

// Appends `tensor`'s elements to `payload` (copied to the CPU, contiguous,
// float32 tensors encoded as `encoding` says; other dtypes raw) and
// describes them in `header`. Supports float32 and int64. Built with
// GEOTRAIN_WITH_CUDA, int8 and int4 encode a CUDA tensor on its device, so
// only the encoded bytes cross to the host.
absl::Status EncodeTensor(const at::Tensor& tensor, v1::TensorHeader* header,
                          std::string* payload, const WireEncoding& encoding = {});

// Decodes the tensor described by `header` from `payload` at `offset` into a
// new tensor: on the CPU, or with `cuda_device` >= 0 on that CUDA device
// (int8/int4 decoded there by the CUDA kernels when built with them, the rest
// decoded on the CPU and copied). Checks header consistency and bounds
// before reading, and that a decoded float tensor is finite.
absl::StatusOr<at::Tensor> DecodeTensor(const v1::TensorHeader& header,
                                        const std::string& payload,
                                        size_t offset, int cuda_device = -1);

// Whether this build has the CUDA codec kernels.
bool HasCudaCodecs();

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_TENSOR_WIRE_H_
