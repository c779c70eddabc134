// Tensor decoding as a receiving stage does it (DecodeTensor: header
// checks, zstd, every codec, finiteness) and each codec's decoder on raw
// bytes. The first piece is a TensorHeader proto, the second its payload.
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/codec.h"
#include "common/link_message.h"
#include "common/tensor_wire.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> pieces = geotrain::SplitFuzzInput(data, size, 3);
  if (pieces.size() < 2) return 0;
  geotrain::v1::TensorHeader header;
  if (!header.ParseFromString(pieces[0])) return 0;
  // Bounded like a link message: nothing decodes past what CheckTensorHeader
  // ties to the shape, but keep single inputs small.
  if (geotrain::CheckTensorHeader(header).ok() && header.encoded_bytes() <= (16u << 20)) {
    (void)geotrain::DecodeTensor(header, pieces[1], 0, -1);
  }
  // Every codec's decoder on the raw payload, for a plausible element count.
  const size_t elements = pieces.size() > 2 ? pieces[2].size() * 16 : 64;
  std::vector<float> out(elements);
  for (geotrain::v1::Codec codec :
       {geotrain::v1::CODEC_NONE, geotrain::v1::CODEC_FP16, geotrain::v1::CODEC_BF16,
        geotrain::v1::CODEC_INT8, geotrain::v1::CODEC_INT4, geotrain::v1::CODEC_TOPK}) {
    for (int block : {32, 64}) {
      geotrain::CodecOptions options;
      options.block_size = block;
      auto made = geotrain::MakeCodec(codec, options);
      if (made.ok()) (void)(*made)->Decode(pieces[1], elements, out.data());
    }
  }
  (void)geotrain::ZstdDecompress(pieces[1], 1 << 20);
  return 0;
}
