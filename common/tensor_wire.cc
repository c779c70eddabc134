#include "common/tensor_wire.h"

#include <torch/torch.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#ifdef GEOTRAIN_WITH_CUDA
#include "common/cuda/block_codec_cuda.h"
#endif
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

bool HasCudaCodecs() {
#ifdef GEOTRAIN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

namespace {

bool IsBlockCodec(v1::Codec codec) {
  return codec == v1::CODEC_INT8 || codec == v1::CODEC_INT4;
}

// Appends `encoded` (zstd'd if asked) and fills the header's codec fields.
absl::Status AppendEncoded(absl::string_view encoded, const WireEncoding& encoding,
                           v1::TensorHeader* header, std::string* payload) {
  header->set_codec(encoding.codec);
  header->set_block_size(encoding.block_size);
  header->set_encoded_bytes(encoded.size());
  header->set_zstd(encoding.zstd);
  const size_t start = payload->size();
  if (encoding.zstd) {
    RETURN_IF_ERROR(ZstdCompress(encoded, 1, payload));
  } else {
    payload->append(encoded.data(), encoded.size());
  }
  header->set_payload_bytes(payload->size() - start);
  return absl::OkStatus();
}

#ifdef GEOTRAIN_WITH_CUDA
// int8/int4 of a CUDA float32 tensor, encoded on its device.
absl::Status EncodeOnDevice(const torch::Tensor& tensor, const WireEncoding& encoding,
                            v1::TensorHeader* header, std::string* payload) {
  const torch::Tensor values = tensor.detach().contiguous();
  const int bits = encoding.codec == v1::CODEC_INT8 ? 8 : 4;
  const size_t n = static_cast<size_t>(values.numel());
  const size_t size = cuda::BlockEncodedSize(n, encoding.block_size, bits);
  torch::Tensor encoded =
      torch::empty({static_cast<int64_t>(size)}, values.options().dtype(torch::kUInt8));
  torch::Tensor nonfinite = torch::zeros({1}, values.options().dtype(torch::kInt32));
  const std::string error = cuda::EncodeBlocksOnDevice(
      values.data_ptr<float>(), n, encoding.block_size, bits,
      static_cast<char*>(encoded.data_ptr()), nonfinite.data_ptr<int>());
  if (!error.empty()) return absl::InternalError(absl::StrCat("CUDA encode: ", error));
  if (nonfinite.item<int>() != 0) {
    return absl::InvalidArgumentError("tensor has non-finite values; refusing to encode");
  }
  const torch::Tensor host = encoded.to(torch::kCPU);
  header->Clear();
  for (int64_t dim : values.sizes()) header->add_shape(dim);
  header->set_dtype(v1::DTYPE_FLOAT32);
  return AppendEncoded(
      absl::string_view(static_cast<const char*>(host.data_ptr()), size), encoding, header,
      payload);
}
#endif

}  // namespace

absl::Status EncodeTensor(const at::Tensor& tensor, v1::TensorHeader* header,
                          std::string* payload, const WireEncoding& encoding) {
  auto dtype = ToWireDType(tensor.scalar_type());
  if (!dtype.ok()) return dtype.status();
  try {
#ifdef GEOTRAIN_WITH_CUDA
    if (tensor.is_cuda() && *dtype == v1::DTYPE_FLOAT32 && IsBlockCodec(encoding.codec)) {
      return EncodeOnDevice(tensor, encoding, header, payload);
    }
#endif
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
    RETURN_IF_ERROR(AppendEncoded(encoded, encoding, header, payload));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("encode: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<at::Tensor> DecodeTensorOnHostOrDevice(const v1::TensorHeader& header,
                                                      const std::string& payload,
                                                      size_t offset, int cuda_device) {
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
#ifdef GEOTRAIN_WITH_CUDA
  if (cuda_device >= 0 && IsBlockCodec(header.codec())) {
    const int bits = header.codec() == v1::CODEC_INT8 ? 8 : 4;
    const torch::TensorOptions on_device =
        torch::TensorOptions().device(torch::Device(torch::kCUDA, cuda_device));
    // CheckTensorHeader has matched encoded_bytes to the shape and block.
    const torch::Tensor encoded =
        torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())},
                         torch::kUInt8)
            .to(on_device);
    torch::Tensor decoded = torch::empty(shape, on_device.dtype(torch::kFloat32));
    torch::Tensor bad_scale = torch::zeros({1}, on_device.dtype(torch::kInt32));
    const std::string error = cuda::DecodeBlocksOnDevice(
        static_cast<const char*>(encoded.data_ptr()), static_cast<size_t>(decoded.numel()),
        static_cast<int>(header.block_size()), bits, decoded.data_ptr<float>(),
        bad_scale.data_ptr<int>());
    if (!error.empty()) return absl::InternalError(absl::StrCat("CUDA decode: ", error));
    if (bad_scale.item<int>() != 0) {
      return absl::InvalidArgumentError("block scale is negative or not finite");
    }
    if (!torch::isfinite(decoded).all().item<bool>()) {
      return absl::InvalidArgumentError("decoded tensor has non-finite values");
    }
    return decoded;
  }
#endif
  CodecOptions options;
  options.block_size = static_cast<int>(header.block_size());
  ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(header.codec(), options));
  RETURN_IF_ERROR(codec->Decode(bytes, out.numel(), out.data_ptr<float>()));
  if (!torch::isfinite(out).all().item<bool>()) {
    return absl::InvalidArgumentError("decoded tensor has non-finite values");
  }
  return out;
}

}  // namespace

absl::StatusOr<at::Tensor> DecodeTensor(const v1::TensorHeader& header,
                                        const std::string& payload, size_t offset,
                                        int cuda_device) {
  try {
    ASSIGN_OR_RETURN(torch::Tensor t, DecodeTensorOnHostOrDevice(header, payload, offset,
                                                                 cuda_device));
    if (cuda_device >= 0 && !t.is_cuda()) t = t.to(torch::Device(torch::kCUDA, cuda_device));
    return t;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("decode: ", e.what_without_backtrace()));
  }
}

}  // namespace geotrain
