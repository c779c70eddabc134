#include "common/layer_state.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace geotrain {
namespace {

// A layer with one [rows, 4] float32 parameter (and its two AdamW tensors)
// whose payload bytes count up, so any misplaced byte shows.
v1::LayerCheckpoint Layer(int layer, int64_t rows) {
  v1::LayerCheckpoint c;
  c.set_layer(layer);
  c.set_step(7);
  c.set_state_per_param(2);
  const uint64_t bytes = static_cast<uint64_t>(rows) * 4 * 4;
  for (v1::TensorHeader* h : {c.add_params(), c.add_optimizer_state(), c.add_optimizer_state()}) {
    h->add_shape(rows);
    h->add_shape(4);
    h->set_dtype(v1::DTYPE_FLOAT32);
    h->set_codec(v1::CODEC_NONE);
    h->set_payload_bytes(bytes);
  }
  std::string* payload = c.mutable_payload();
  for (uint64_t i = 0; i < 3 * bytes; ++i) payload->push_back(static_cast<char>(i * 7 + layer));
  return c;
}

std::vector<v1::LayerStateChunk> Chunks(const v1::LayerCheckpoint& layer, size_t chunk_bytes) {
  std::vector<v1::LayerStateChunk> chunks;
  EXPECT_TRUE(ForEachLayerStateChunk(layer, chunk_bytes, [&](const v1::LayerStateChunk& c) {
    chunks.push_back(c);
    return true;
  }));
  return chunks;
}

TEST(LayerStateTest, ALayerCrossesInChunksAndArrivesWhole) {
  const v1::LayerCheckpoint a = Layer(3, 1000), b = Layer(4, 1);
  LayerStateCollector collector;
  LayerStateReceiver receiver(&collector, 1 << 20);
  std::vector<v1::LayerStateChunk> chunks = Chunks(a, 4096);
  ASSERT_EQ(chunks.size(), 12u);  // 48000 bytes
  EXPECT_TRUE(chunks[0].has_header());
  EXPECT_TRUE(chunks[0].header().payload().empty());
  EXPECT_FALSE(chunks[1].has_header());
  for (const v1::LayerStateChunk& c : chunks) EXPECT_LE(c.data().size(), 4096u);
  for (const auto& c : chunks) ASSERT_TRUE(receiver.Add(c).ok());
  for (const auto& c : Chunks(b, 4096)) ASSERT_TRUE(receiver.Add(c).ok());
  ASSERT_TRUE(receiver.Finish().ok());
  ASSERT_EQ(collector.layers().size(), 2u);
  EXPECT_EQ(collector.layers()[0].SerializeAsString(), a.SerializeAsString());
  EXPECT_EQ(collector.layers()[1].SerializeAsString(), b.SerializeAsString());
  EXPECT_EQ(receiver.payload_bytes_received(), a.payload().size() + b.payload().size());
}

// Bytes fed in pieces of any size (a file read, one tensor at a time) make
// the same chunks as the whole payload at once; the chunker refuses more or
// fewer bytes than declared and stops at a broken stream.
TEST(LayerStateTest, TheChunkerCutsPiecesOfAnySizeTheSameWay) {
  const v1::LayerCheckpoint a = Layer(3, 1000);
  const std::vector<v1::LayerStateChunk> whole = Chunks(a, 4096);
  std::vector<v1::LayerStateChunk> pieces;
  const LayerStateEmit keep = [&](const v1::LayerStateChunk& c) {
    pieces.push_back(c);
    return true;
  };
  LayerStateChunker chunker(LayerStateHeader(a), a.payload().size(), keep, 4096);
  const absl::string_view payload = a.payload();
  for (size_t offset = 0, n = 1; offset < payload.size(); offset += n, n = n * 3 + 1) {
    ASSERT_TRUE(chunker.Append(payload.substr(offset, n)).ok());
  }
  ASSERT_TRUE(chunker.Finish().ok());
  ASSERT_EQ(pieces.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_EQ(pieces[i].SerializeAsString(), whole[i].SerializeAsString()) << "chunk " << i;
  }

  LayerStateChunker over(LayerStateHeader(a), 8, keep, 4096);
  EXPECT_EQ(over.Append(std::string(9, 'x')).code(), absl::StatusCode::kInternal);
  LayerStateChunker under(LayerStateHeader(a), 8, keep, 4096);
  ASSERT_TRUE(under.Append(std::string(4, 'x')).ok());
  EXPECT_EQ(under.Finish().code(), absl::StatusCode::kInternal);

  int emitted = 0;
  const LayerStateEmit broken = [&](const v1::LayerStateChunk&) { return ++emitted < 2; };
  LayerStateChunker cut(LayerStateHeader(a), a.payload().size(), broken, 4096);
  EXPECT_EQ(cut.Append(a.payload()).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(cut.Finish().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(emitted, 2) << "nothing is emitted after the stream broke";
}

TEST(LayerStateTest, AnEmptyPayloadIsOneChunk) {
  v1::LayerCheckpoint probe;
  probe.set_layer(2);
  std::vector<v1::LayerStateChunk> chunks = Chunks(probe, kLayerStateChunkBytes);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_TRUE(chunks[0].last());
  LayerStateCollector collector;
  LayerStateReceiver receiver(&collector, 0);
  EXPECT_TRUE(receiver.Add(chunks[0]).ok());
  EXPECT_EQ(collector.layers().size(), 1u);
}

// Each way a stream can be wrong is refused with a reason, before the sink
// sees the bad part.
TEST(LayerStateTest, MalformedStreamsAreRefused) {
  const v1::LayerCheckpoint layer = Layer(1, 100);  // 4800 bytes
  struct Case {
    const char* name;
    void (*damage)(std::vector<v1::LayerStateChunk>&);
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"no header", [](auto& c) { c[0].clear_header(); }, absl::StatusCode::kInvalidArgument},
      {"understated size", [](auto& c) { c[0].set_payload_bytes(100); },
       absl::StatusCode::kInvalidArgument},
      {"header carries a payload", [](auto& c) { c[0].mutable_header()->set_payload("x"); },
       absl::StatusCode::kInvalidArgument},
      {"a second header", [](auto& c) { *c[1].mutable_header() = c[0].header(); },
       absl::StatusCode::kInvalidArgument},
      {"odd chunk", [](auto& c) { c[1].mutable_data()->push_back('x'); },
       absl::StatusCode::kInvalidArgument},
      {"a chunk too many", [](auto& c) { c.insert(c.begin() + 1, c[1]); },
       absl::StatusCode::kInvalidArgument},
      {"cut short", [](auto& c) { c.pop_back(); c.back().set_last(true); },
       absl::StatusCode::kInvalidArgument},
      {"flipped byte", [](auto& c) { (*c[1].mutable_data())[5] ^= 1; },
       absl::StatusCode::kDataLoss},
      {"wrong checksum", [](auto& c) { c.back().set_payload_crc32(c.back().payload_crc32() + 1); },
       absl::StatusCode::kDataLoss},
  };
  for (const Case& test : cases) {
    std::vector<v1::LayerStateChunk> chunks = Chunks(layer, 1024);
    test.damage(chunks);
    LayerStateCollector collector;
    LayerStateReceiver receiver(&collector, 1 << 20);
    absl::Status status;
    for (const auto& c : chunks) {
      status = receiver.Add(c);
      if (!status.ok()) break;
    }
    if (status.ok()) status = receiver.Finish();
    EXPECT_EQ(status.code(), test.code) << test.name << ": " << status;
    EXPECT_FALSE(status.message().empty()) << test.name;
  }
}

TEST(LayerStateTest, ALayerOverTheLimitIsRefusedBeforeAnythingIsReserved) {
  v1::LayerCheckpoint huge = Layer(0, 1);
  for (v1::TensorHeader& h : *huge.mutable_params()) h.set_payload_bytes(uint64_t{1} << 50);
  huge.clear_payload();
  LayerStateCollector collector;
  LayerStateReceiver receiver(&collector, kMaxLayerStateBytes);
  v1::LayerStateChunk chunk;
  *chunk.mutable_header() = huge;
  chunk.set_payload_bytes(DeclaredPayloadBytes(huge));
  const absl::Status status = receiver.Add(chunk);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("at most"), std::string::npos) << status;
  EXPECT_TRUE(collector.layers().empty());
}

}  // namespace
}  // namespace geotrain
