// CPU encode + decode throughput of every codec on 1 Mi float32 values
// (4 MiB), one thread. Run: build/bench/codecs
// bytes_per_second counts raw float32 bytes through encode and decode.
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "common/codec.h"

namespace geotrain {
namespace {

void BM_EncodeDecode(benchmark::State& state, v1::Codec id, bool zstd) {
  const size_t n = 1 << 20;
  std::vector<float> values(n), decoded(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0, 1);
  for (float& v : values) v = normal(rng);
  CodecOptions options;
  options.topk_fraction = 0.01;
  auto codec = *MakeCodec(id, options);
  std::string encoded, compressed;
  for (auto _ : state) {
    encoded.clear();
    if (!codec->Encode(values.data(), n, &encoded).ok()) state.SkipWithError("encode");
    if (zstd) {
      compressed.clear();
      (void)ZstdCompress(encoded, 1, &compressed);
      encoded = *ZstdDecompress(compressed, encoded.size());
    }
    if (!codec->Decode(encoded, n, decoded.data()).ok()) state.SkipWithError("decode");
    benchmark::DoNotOptimize(decoded.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n * sizeof(float));
  state.counters["ratio"] = static_cast<double>(n * sizeof(float)) /
                            (zstd ? compressed.size() : encoded.size());
}

BENCHMARK_CAPTURE(BM_EncodeDecode, none, v1::CODEC_NONE, false);
BENCHMARK_CAPTURE(BM_EncodeDecode, fp16, v1::CODEC_FP16, false);
BENCHMARK_CAPTURE(BM_EncodeDecode, bf16, v1::CODEC_BF16, false);
BENCHMARK_CAPTURE(BM_EncodeDecode, int8, v1::CODEC_INT8, false);
BENCHMARK_CAPTURE(BM_EncodeDecode, int4, v1::CODEC_INT4, false);
BENCHMARK_CAPTURE(BM_EncodeDecode, topk_1pct, v1::CODEC_TOPK, false);
BENCHMARK_CAPTURE(BM_EncodeDecode, int8_zstd, v1::CODEC_INT8, true);

}  // namespace
}  // namespace geotrain
