// CUDA kernels for the int8 and int4 blockwise absmax codecs, producing and
// reading exactly the wire layout of common/codec.h's CPU codecs (per block:
// a float32 scale = absmax / levels, then one int8 per value or two signed
// 4-bit values per byte), so either side of a link may use either path.
//
// Built only with -DGEOTRAIN_WITH_CUDA=ON. Pointers are device memory on
// the current device: the caller makes the tensors' device current (a
// device guard) and passes the stream to launch on, as a cudaStream_t
// (the compute stream; nullptr is the legacy default stream). The kernels
// run asynchronously; callers read results (and the flags) after that
// stream has been synchronised, e.g. by a copy to the host.
// Plain C++ interface (no CUDA or absl types), so the .cu file stays small.
#ifndef GEOTRAIN_COMMON_CUDA_BLOCK_CODEC_CUDA_H_
#define GEOTRAIN_COMMON_CUDA_BLOCK_CODEC_CUDA_H_

#include <cstddef>
#include <string>

namespace geotrain::cuda {

// Bytes of the encoding of n values in blocks of `block` with `bits` (8|4).
size_t BlockEncodedSize(size_t n, int block, int bits);

// Encodes values[0, n) into out[0, BlockEncodedSize). Sets *nonfinite (a
// device int the caller zeroed) to 1 when any value is NaN or infinite.
// Returns "" or the CUDA error.
std::string EncodeBlocksOnDevice(const float* values, size_t n, int block, int bits, char* out,
                                 int* nonfinite, void* stream);

// Decodes payload[0, BlockEncodedSize) into out[0, n). Sets *bad (a device
// int the caller zeroed) to 1 when a block's scale is negative or not
// finite, or a decoded value overflows to infinity. Returns "" or the CUDA
// error.
std::string DecodeBlocksOnDevice(const char* payload, size_t n, int block, int bits, float* out,
                                 int* bad, void* stream);

// Number of CUDA devices visible (0 without a driver or GPU).
int CudaDeviceCount();

}  // namespace geotrain::cuda

#endif  // GEOTRAIN_COMMON_CUDA_BLOCK_CODEC_CUDA_H_
