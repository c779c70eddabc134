#include "common/tensor_wire.h"

#include <torch/torch.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/link_message.h"

namespace geotrain {
namespace {

absl::StatusOr<v1::DType> ToWireDType(c10::ScalarType type) {
  switch (type) {
    case torch::kFloat32:
      return v1::DTYPE_FLOAT32;
    case torch::kInt64:
      return v1::DTYPE_INT64;
    case torch::kFloat16:
      return v1::DTYPE_FLOAT16;
    case torch::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unsupported tensor dtype ", c10::toString(type)));
  }
}

c10::ScalarType ToTorchDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_INT64:
      return torch::kInt64;
    case v1::DTYPE_FLOAT16:
      return torch::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return torch::kBFloat16;
    default:
      return torch::kFloat32;
  }
}

}  // namespace

absl::Status EncodeTensor(const at::Tensor& tensor, v1::TensorHeader* header,
                          std::string* payload) {
  auto dtype = ToWireDType(tensor.scalar_type());
  if (!dtype.ok()) return dtype.status();
  try {
    torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
    header->Clear();
    for (int64_t dim : cpu.sizes()) header->add_shape(dim);
    header->set_dtype(*dtype);
    header->set_codec(v1::CODEC_NONE);
    const size_t bytes = cpu.numel() * cpu.element_size();
    header->set_payload_bytes(bytes);
    payload->append(static_cast<const char*>(cpu.data_ptr()), bytes);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("encode: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> DecodeTensor(const v1::TensorHeader& header,
                                        const std::string& payload,
                                        size_t offset) {
  absl::Status valid = CheckTensorHeader(header);
  if (!valid.ok()) return valid;
  if (offset > payload.size() ||
      payload.size() - offset < header.payload_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor of ", header.payload_bytes(), " bytes at offset ", offset,
        " runs past the ", payload.size(), "-byte payload"));
  }
  std::vector<int64_t> shape(header.shape().begin(), header.shape().end());
  torch::Tensor out =
      torch::empty(shape, torch::TensorOptions().dtype(ToTorchDType(header.dtype())));
  if (header.payload_bytes() > 0) {
    std::memcpy(out.data_ptr(), payload.data() + offset, header.payload_bytes());
  }
  return out;
}

}  // namespace geotrain
