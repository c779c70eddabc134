#include "common/tensor_wire.h"

#include <torch/torch.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/link_message.h"
#include "common/status_macros.h"

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
                          std::string* payload, const WireEncoding& encoding) {
  auto dtype = ToWireDType(tensor.scalar_type());
  if (!dtype.ok()) return dtype.status();
  try {
    torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
    header->Clear();
    for (int64_t dim : cpu.sizes()) header->add_shape(dim);
    header->set_dtype(*dtype);
    const size_t raw_bytes = cpu.numel() * cpu.element_size();
    const v1::Codec codec_id = *dtype == v1::DTYPE_FLOAT32 ? encoding.codec : v1::CODEC_NONE;
    if (codec_id == v1::CODEC_NONE && !encoding.zstd) {
      header->set_codec(v1::CODEC_NONE);
      header->set_payload_bytes(raw_bytes);
      payload->append(static_cast<const char*>(cpu.data_ptr()), raw_bytes);
      return absl::OkStatus();
    }
    if (codec_id == v1::CODEC_NONE) {  // raw elements of any dtype, zstd'd
      header->set_codec(v1::CODEC_NONE);
      header->set_zstd(true);
      header->set_encoded_bytes(raw_bytes);
      const size_t start = payload->size();
      RETURN_IF_ERROR(ZstdCompress(
          absl::string_view(static_cast<const char*>(cpu.data_ptr()), raw_bytes), 1, payload));
      header->set_payload_bytes(payload->size() - start);
      return absl::OkStatus();
    }
    CodecOptions options;
    options.block_size = encoding.block_size;
    options.topk_fraction = encoding.topk_fraction;
    ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(encoding.codec, options));
    std::string encoded;
    RETURN_IF_ERROR(codec->Encode(cpu.data_ptr<float>(), cpu.numel(), &encoded));
    header->set_codec(encoding.codec);
    header->set_block_size(encoding.block_size);
    header->set_encoded_bytes(encoded.size());
    header->set_zstd(encoding.zstd);
    const size_t start = payload->size();
    if (encoding.zstd) {
      RETURN_IF_ERROR(ZstdCompress(encoded, 1, payload));
    } else {
      payload->append(encoded);
    }
    header->set_payload_bytes(payload->size() - start);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("encode: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> DecodeTensor(const v1::TensorHeader& header,
                                        const std::string& payload,
                                        size_t offset) {
  RETURN_IF_ERROR(CheckTensorHeader(header));
  if (offset > payload.size() ||
      payload.size() - offset < header.payload_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor of ", header.payload_bytes(), " bytes at offset ", offset,
        " runs past the ", payload.size(), "-byte payload"));
  }
  std::vector<int64_t> shape(header.shape().begin(), header.shape().end());
  torch::Tensor out =
      torch::empty(shape, torch::TensorOptions().dtype(ToTorchDType(header.dtype())));
  absl::string_view bytes(payload.data() + offset, header.payload_bytes());
  if (header.codec() == v1::CODEC_NONE && !header.zstd()) {
    if (!bytes.empty()) std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
    return out;
  }
  std::string decompressed;
  if (header.zstd()) {
    ASSIGN_OR_RETURN(decompressed, ZstdDecompress(bytes, header.encoded_bytes()));
    if (decompressed.size() != header.encoded_bytes()) {
      return absl::InvalidArgumentError("zstd frame does not hold the announced encoding");
    }
    bytes = decompressed;
  }
  if (header.codec() == v1::CODEC_NONE) {
    if (!bytes.empty()) std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
    if (header.dtype() != v1::DTYPE_FLOAT32) return out;
    if (!torch::isfinite(out).all().item<bool>()) {
      return absl::InvalidArgumentError("decoded tensor has non-finite values");
    }
    return out;
  }
  CodecOptions options;
  options.block_size = static_cast<int>(header.block_size());
  ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(header.codec(), options));
  RETURN_IF_ERROR(codec->Decode(bytes, out.numel(), out.data_ptr<float>()));
  if (!torch::isfinite(out).all().item<bool>()) {
    return absl::InvalidArgumentError("decoded tensor has non-finite values");
  }
  return out;
}

}  // namespace geotrain
