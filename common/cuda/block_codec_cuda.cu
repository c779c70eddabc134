#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda/block_codec_cuda.h"

namespace geotrain::cuda {
namespace {

constexpr int kThreads = 128;

__host__ __device__ size_t BlockBytes(size_t count, int bits) {
  return sizeof(float) + (bits == 8 ? count : (count + 1) / 2);
}

// One CUDA block per codec block: reduce |x| to the block's absmax, then
// quantise with round-to-nearest-even, as std::lrintf does on the CPU.
__global__ void EncodeKernel(const float* values, size_t n, int block, int bits, char* out,
                             int* nonfinite) {
  const size_t b = blockIdx.x;
  const size_t begin = b * static_cast<size_t>(block);
  const size_t count = min(static_cast<size_t>(block), n - begin);
  const float* in = values + begin;
  char* dst = out + b * BlockBytes(block, bits);
  __shared__ float partial[kThreads];
  float absmax = 0.0f;
  for (size_t i = threadIdx.x; i < count; i += blockDim.x) {
    const float v = in[i];
    if (!isfinite(v)) atomicExch(nonfinite, 1);
    absmax = fmaxf(absmax, fabsf(v));
  }
  partial[threadIdx.x] = absmax;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  const float levels = bits == 8 ? 127.0f : 7.0f;
  const float scale = __fdiv_rn(partial[0], levels);
  const float inverse = scale > 0 ? __fdiv_rn(1.0f, scale) : 0.0f;
  if (threadIdx.x == 0) {
    const char* bytes = reinterpret_cast<const char*>(&scale);
    for (int k = 0; k < 4; ++k) dst[k] = bytes[k];  // blocks need not be aligned
  }
  char* q = dst + sizeof(float);
  if (bits == 8) {
    for (size_t i = threadIdx.x; i < count; i += blockDim.x) {
      q[i] = static_cast<char>(static_cast<int8_t>(__float2int_rn(__fmul_rn(in[i], inverse))));
    }
  } else {
    for (size_t j = threadIdx.x; 2 * j < count; j += blockDim.x) {
      const int lo = __float2int_rn(__fmul_rn(in[2 * j], inverse));
      const int hi = 2 * j + 1 < count ? __float2int_rn(__fmul_rn(in[2 * j + 1], inverse)) : 0;
      q[j] = static_cast<char>((lo & 0x0F) | ((hi & 0x0F) << 4));
    }
  }
}

__global__ void DecodeKernel(const char* payload, size_t n, int block, int bits, float* out,
                             int* bad_scale) {
  const size_t b = blockIdx.x;
  const size_t begin = b * static_cast<size_t>(block);
  const size_t count = min(static_cast<size_t>(block), n - begin);
  const char* src = payload + b * BlockBytes(block, bits);
  float scale;
  char* bytes = reinterpret_cast<char*>(&scale);
  for (int k = 0; k < 4; ++k) bytes[k] = src[k];
  if (!isfinite(scale) || scale < 0) {
    if (threadIdx.x == 0) atomicExch(bad_scale, 1);
    return;
  }
  const char* q = src + sizeof(float);
  for (size_t i = threadIdx.x; i < count; i += blockDim.x) {
    int level;
    if (bits == 8) {
      level = static_cast<int8_t>(q[i]);
    } else {
      const uint8_t byte = static_cast<uint8_t>(q[i / 2]);
      level = (i % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
      if (level >= 8) level -= 16;
    }
    const float value = __fmul_rn(scale, static_cast<float>(level));
    if (!isfinite(value)) atomicExch(bad_scale, 1);
    out[begin + i] = value;
  }
}

std::string LaunchError() {
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? "" : cudaGetErrorString(error);
}

bool ValidArguments(size_t n, int block, int bits) {
  return block > 0 && (bits == 8 || bits == 4) && n / static_cast<size_t>(block) < (1u << 31);
}

}  // namespace

size_t BlockEncodedSize(size_t n, int block, int bits) {
  const size_t full = n / block, rest = n % block;
  return full * BlockBytes(block, bits) + (rest ? BlockBytes(rest, bits) : 0);
}

std::string EncodeBlocksOnDevice(const float* values, size_t n, int block, int bits, char* out,
                                 int* nonfinite, void* stream) {
  if (!ValidArguments(n, block, bits)) return "invalid block size or bits";
  if (n == 0) return "";
  const unsigned blocks = static_cast<unsigned>((n + block - 1) / block);
  EncodeKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(values, n, block, bits,
                                                                          out, nonfinite);
  return LaunchError();
}

std::string DecodeBlocksOnDevice(const char* payload, size_t n, int block, int bits, float* out,
                                 int* bad, void* stream) {
  if (!ValidArguments(n, block, bits)) return "invalid block size or bits";
  if (n == 0) return "";
  const unsigned blocks = static_cast<unsigned>((n + block - 1) / block);
  DecodeKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(payload, n, block, bits,
                                                                          out, bad);
  return LaunchError();
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

}  // namespace geotrain::cuda
