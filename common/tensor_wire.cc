#include "common/tensor_wire.h"

#include <torch/torch.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/link_frame_wire.h"
#include "common/link_message.h"
#include "common/staging_pool.h"
#include "common/status_macros.h"
#ifdef GEOTRAIN_WITH_CUDA
#include "common/cuda/block_codec_cuda.h"
#endif
#ifdef GEOTRAIN_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

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
    PayloadCopies().staging.fetch_add(encoded.size(), std::memory_order_relaxed);
  }
  header->set_payload_bytes(payload->size() - start);
  return absl::OkStatus();
}

// The host side of every encoding: `bytes` hold `numel` elements of `dtype`.
absl::Status EncodeHostBytes(const char* bytes, size_t numel, v1::DType dtype,
                             at::IntArrayRef shape, const WireEncoding& encoding,
                             v1::TensorHeader* header, std::string* payload) {
  header->Clear();
  for (int64_t dim : shape) header->add_shape(dim);
  header->set_dtype(dtype);
  const size_t element_size = dtype == v1::DTYPE_INT64     ? 8
                              : dtype == v1::DTYPE_FLOAT32 ? 4
                                                           : 2;
  const size_t raw_bytes = numel * element_size;
  const v1::Codec codec_id = dtype == v1::DTYPE_FLOAT32 ? encoding.codec : v1::CODEC_NONE;
  if (codec_id == v1::CODEC_NONE && !encoding.zstd) {
    header->set_codec(v1::CODEC_NONE);
    header->set_payload_bytes(raw_bytes);
    payload->append(bytes, raw_bytes);
    PayloadCopies().tensor_to_payload.fetch_add(raw_bytes, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  if (codec_id == v1::CODEC_NONE) {  // raw elements of any dtype, zstd'd
    header->set_codec(v1::CODEC_NONE);
    header->set_zstd(true);
    header->set_encoded_bytes(raw_bytes);
    const size_t start = payload->size();
    RETURN_IF_ERROR(ZstdCompress(absl::string_view(bytes, raw_bytes), 1, payload));
    header->set_payload_bytes(payload->size() - start);
    return absl::OkStatus();
  }
  CodecOptions options;
  options.block_size = encoding.block_size;
  options.topk_fraction = encoding.topk_fraction;
  ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(encoding.codec, options));
  const float* values = reinterpret_cast<const float*>(bytes);
  if (!encoding.zstd) {  // the codec writes the payload's bytes in place
    const size_t start = payload->size();
    if (absl::Status encoded = codec->Encode(values, numel, payload); !encoded.ok()) {
      payload->resize(start);
      return encoded;
    }
    header->set_codec(encoding.codec);
    header->set_block_size(encoding.block_size);
    header->set_encoded_bytes(payload->size() - start);
    header->set_payload_bytes(payload->size() - start);
    PayloadCopies().tensor_to_payload.fetch_add(payload->size() - start,
                                                std::memory_order_relaxed);
    return absl::OkStatus();
  }
  std::string encoded;
  RETURN_IF_ERROR(codec->Encode(values, numel, &encoded));
  PayloadCopies().tensor_to_payload.fetch_add(encoded.size(), std::memory_order_relaxed);
  return AppendEncoded(encoded, encoding, header, payload);
}

#ifdef GEOTRAIN_WITH_CUDA
// Device buffers of the block codecs start with a 4-byte int flag (aligned
// for the kernels' atomics), so that one copy brings flag and bytes back.
constexpr int64_t kFlagBytes = 4;

// int8/int4 of a CUDA float32 tensor, encoded on its device, on its current
// stream; the bytes and the non-finite flag cross in one staged copy.
absl::Status EncodeOnDevice(const torch::Tensor& tensor, const WireEncoding& encoding,
                            HostStagingPool& staging, v1::TensorHeader* header,
                            std::string* payload) {
  const c10::cuda::CUDAGuard guard(tensor.device());
  const torch::Tensor values = tensor.detach().contiguous();
  const int bits = encoding.codec == v1::CODEC_INT8 ? 8 : 4;
  const size_t n = static_cast<size_t>(values.numel());
  const size_t size = cuda::BlockEncodedSize(n, encoding.block_size, bits);
  torch::Tensor buffer = torch::empty({kFlagBytes + static_cast<int64_t>(size)},
                                      values.options().dtype(torch::kUInt8));
  buffer.narrow(0, 0, kFlagBytes).zero_();
  const std::string error = cuda::EncodeBlocksOnDevice(
      values.data_ptr<float>(), n, encoding.block_size, bits,
      static_cast<char*>(buffer.data_ptr()) + kFlagBytes, static_cast<int*>(buffer.data_ptr()),
      c10::cuda::getCurrentCUDAStream(values.device().index()).stream());
  if (!error.empty()) return absl::InternalError(absl::StrCat("CUDA encode: ", error));
  ASSIGN_OR_RETURN(HostStagingPool::Lease host, staging.CopyToHost(buffer));
  int nonfinite = 0;
  std::memcpy(&nonfinite, host.data(), sizeof(nonfinite));
  if (nonfinite != 0) {
    return absl::InvalidArgumentError("tensor has non-finite values; refusing to encode");
  }
  header->Clear();
  for (int64_t dim : values.sizes()) header->add_shape(dim);
  header->set_dtype(v1::DTYPE_FLOAT32);
  return AppendEncoded(absl::string_view(host.data() + kFlagBytes, size), encoding, header,
                       payload);
}
#endif

}  // namespace

bool HasCudaCodecs() {
#ifdef GEOTRAIN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

struct DeferredDeviceChecks::Flag {
  torch::Tensor host;  // pinned int32, filled by an asynchronous copy
  const char* what;
};

DeferredDeviceChecks::DeferredDeviceChecks() = default;
DeferredDeviceChecks::~DeferredDeviceChecks() = default;
bool DeferredDeviceChecks::empty() const { return flags_.empty(); }

void DeferredDeviceChecks::Add(const at::Tensor& device_flag, const char* what) {
  torch::Tensor host = torch::empty(
      {1}, torch::TensorOptions().dtype(torch::kInt32).pinned_memory(device_flag.is_cuda()));
  host.copy_(device_flag, /*non_blocking=*/true);
  flags_.push_back({host, what});
}

absl::Status DeferredDeviceChecks::Verify() {
  absl::Status status;
  for (const Flag& flag : flags_) {
    if (status.ok() && *flag.host.data_ptr<int>() != 0) {
      status = absl::InvalidArgumentError(flag.what);
    }
  }
  flags_.clear();
  return status;
}

absl::Status DeferredDeviceChecks::SynchronizeAndVerify() {
  if (flags_.empty()) return absl::OkStatus();
#ifdef GEOTRAIN_TORCH_CUDA
  try {
    c10::cuda::getCurrentCUDAStream().synchronize();
  } catch (const c10::Error& e) {
    flags_.clear();
    return absl::InternalError(absl::StrCat("synchronising: ", e.what_without_backtrace()));
  }
#endif
  return Verify();
}

absl::Status EncodeTensor(const at::Tensor& tensor, v1::TensorHeader* header,
                          std::string* payload, const WireEncoding& encoding,
                          HostStagingPool* staging) {
  auto dtype = ToWireDType(tensor.scalar_type());
  if (!dtype.ok()) return dtype.status();
  try {
    HostStagingPool& pool = staging != nullptr ? *staging : HostStagingPool::Shared();
#ifdef GEOTRAIN_WITH_CUDA
    if (tensor.is_cuda() && *dtype == v1::DTYPE_FLOAT32 && IsBlockCodec(encoding.codec)) {
      return EncodeOnDevice(tensor, encoding, pool, header, payload);
    }
#endif
    if (tensor.device().is_cpu() && staging == nullptr) {
      const torch::Tensor cpu = tensor.detach().contiguous();
      return EncodeHostBytes(static_cast<const char*>(cpu.data_ptr()), cpu.numel(), *dtype,
                             cpu.sizes(), encoding, header, payload);
    }
    ASSIGN_OR_RETURN(HostStagingPool::Lease host, pool.CopyToHost(tensor));
    return EncodeHostBytes(host.data(), tensor.numel(), *dtype, tensor.sizes(), encoding, header,
                           payload);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("encode: ", e.what_without_backtrace()));
  }
}

namespace {

absl::StatusOr<at::Tensor> DecodeOnHost(const v1::TensorHeader& header, absl::string_view bytes,
                                        const std::vector<int64_t>& shape) {
  torch::Tensor out =
      torch::empty(shape, torch::TensorOptions().dtype(ToTorchDType(header.dtype())));
  if (header.codec() == v1::CODEC_NONE && !header.zstd()) {
    if (!bytes.empty()) std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
    PayloadCopies().payload_to_tensor.fetch_add(bytes.size(), std::memory_order_relaxed);
    return out;
  }
  std::string decompressed;
  if (header.zstd()) {
    ASSIGN_OR_RETURN(decompressed, ZstdDecompress(bytes, header.encoded_bytes()));
    if (decompressed.size() != header.encoded_bytes()) {
      return absl::InvalidArgumentError("zstd frame does not hold the announced encoding");
    }
    bytes = decompressed;
    PayloadCopies().staging.fetch_add(decompressed.size(), std::memory_order_relaxed);
  }
  PayloadCopies().payload_to_tensor.fetch_add(bytes.size(), std::memory_order_relaxed);
  if (header.codec() == v1::CODEC_NONE) {
    if (!bytes.empty()) std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
    if (header.dtype() != v1::DTYPE_FLOAT32) return out;
  } else {
    CodecOptions options;
    options.block_size = static_cast<int>(header.block_size());
    ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(header.codec(), options));
    RETURN_IF_ERROR(codec->Decode(bytes, out.numel(), out.data_ptr<float>()));
  }
  if (!torch::isfinite(out).all().item<bool>()) {  // a host tensor: no device sync
    return absl::InvalidArgumentError("decoded tensor has non-finite values");
  }
  return out;
}

}  // namespace

absl::StatusOr<at::Tensor> DecodeTensor(const v1::TensorHeader& header,
                                        const std::string& payload, size_t offset,
                                        int cuda_device, DeferredDeviceChecks* device_checks) {
  RETURN_IF_ERROR(CheckTensorHeader(header));
  if (offset > payload.size() || payload.size() - offset < header.payload_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor of ", header.payload_bytes(), " bytes at offset ", offset,
        " runs past the ", payload.size(), "-byte payload"));
  }
  const std::vector<int64_t> shape(header.shape().begin(), header.shape().end());
  const absl::string_view bytes(payload.data() + offset, header.payload_bytes());
  try {
#ifdef GEOTRAIN_WITH_CUDA
    if (cuda_device >= 0 && IsBlockCodec(header.codec()) && !header.zstd()) {
      const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(cuda_device));
      const c10::cuda::CUDAGuard guard(device);
      // CheckTensorHeader has matched encoded_bytes to the shape and block.
      ASSIGN_OR_RETURN(torch::Tensor encoded,
                       HostStagingPool::Shared().CopyToDevice(bytes, cuda_device));
      const torch::TensorOptions on_device = torch::TensorOptions().device(device);
      torch::Tensor decoded = torch::empty(shape, on_device.dtype(torch::kFloat32));
      torch::Tensor bad = torch::zeros({1}, on_device.dtype(torch::kInt32));
      const std::string error = cuda::DecodeBlocksOnDevice(
          static_cast<const char*>(encoded.data_ptr()), static_cast<size_t>(decoded.numel()),
          static_cast<int>(header.block_size()), header.codec() == v1::CODEC_INT8 ? 8 : 4,
          decoded.data_ptr<float>(), bad.data_ptr<int>(),
          c10::cuda::getCurrentCUDAStream(device.index()).stream());
      if (!error.empty()) return absl::InternalError(absl::StrCat("CUDA decode: ", error));
      constexpr char kBad[] = "a block scale is negative or not finite, or a value overflows";
      if (device_checks != nullptr) {
        device_checks->Add(bad, kBad);
      } else {
        DeferredDeviceChecks now;
        now.Add(bad, kBad);
        RETURN_IF_ERROR(now.SynchronizeAndVerify());
      }
      return decoded;
    }
#endif
    ASSIGN_OR_RETURN(torch::Tensor host, DecodeOnHost(header, bytes, shape));
    if (cuda_device < 0) return host;
    const size_t raw = static_cast<size_t>(host.numel()) * host.element_size();
    ASSIGN_OR_RETURN(torch::Tensor device_bytes,
                     HostStagingPool::Shared().CopyToDevice(
                         absl::string_view(static_cast<const char*>(host.data_ptr()), raw),
                         cuda_device));
    return device_bytes.view(host.scalar_type()).view(shape);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("decode: ", e.what_without_backtrace()));
  }
}

}  // namespace geotrain
