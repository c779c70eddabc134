// Model state on the wire: one layer's LayerCheckpoint as a run of
// LayerStateChunks of about 1 MiB, with a CRC-32 over the whole payload
// (proto/geotrain/v1/coordinator.proto). The same chunks carry checkpoint
// uploads and restores (worker <-> coordinator) and state a newcomer takes
// from a live peer (StageState), so no message grows with a layer and no
// layer is ever held twice in full as protobuf.
//
// Sending: ForEachLayerStateChunk slices a layer's payload without copying
// it whole. Receiving: LayerStateReceiver checks the chunk sequence (header
// first, sizes as declared, multiples of 4, the checksum) and hands the bytes
// to a LayerStateSink: in memory for a worker (LayerStateCollector), a file
// for the coordinator. Not thread-safe; one receiver per stream.
#ifndef GEOTRAIN_COMMON_LAYER_STATE_H_
#define GEOTRAIN_COMMON_LAYER_STATE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/rpc_options.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

// Payload bytes per chunk (a multiple of 4: every value is float32).
inline constexpr size_t kLayerStateChunkBytes = kStreamPartBytes;
// The largest layer (weights and optimizer state) a receiver accepts by
// default: 64 GiB, far beyond any real layer, so a forged header cannot
// make it reserve more.
inline constexpr uint64_t kMaxLayerStateBytes = uint64_t{64} << 30;

// The most state a layer of `job` can have: its float32 parameters and two
// optimizer tensors per parameter (AdamW's m and v), and with pipelines the
// outer weights and momentum. What a worker accepts for that layer.
uint64_t MaxLayerStateBytes(const v1::JobSpec& job, int layer);
// The most a replica's push of that layer's weights (parameters alone) can
// hold: twice their float32 size, since int8 and int4 with the smallest
// codec_block_size (1) take 5 bytes a value.
uint64_t MaxLayerWeightsBytes(const v1::JobSpec& job, int layer);

// `layer` without its payload (the first chunk's header).
v1::LayerCheckpoint LayerStateHeader(const v1::LayerCheckpoint& layer);

// The sum of payload_bytes over the header's tensors: what the payload must
// hold.
uint64_t DeclaredPayloadBytes(const v1::LayerCheckpoint& header);

// CRC-32 (zlib) of `data` continuing from `crc` (0 to start).
uint32_t Crc32Update(uint32_t crc, absl::string_view data);

using LayerStateEmit = std::function<bool(const v1::LayerStateChunk&)>;

// Cuts one layer's state into chunks as its bytes come, in pieces of any
// size (a file read, one tensor at a time): the first chunk carries the
// header and the declared size, each holds `chunk_bytes`, and the last one
// the rest, `last` and the CRC-32 of the whole. The one slicer behind every
// sender of layer state (memory, a live stage, the coordinator's files).
class LayerStateChunker {
 public:
  // `emit` returns false when the stream broke; it must outlive the chunker.
  LayerStateChunker(const v1::LayerCheckpoint& header, uint64_t payload_bytes,
                    const LayerStateEmit& emit, size_t chunk_bytes = kLayerStateChunkBytes);
  // CANCELLED once the stream broke; INTERNAL past the declared size.
  absl::Status Append(absl::string_view bytes);
  // Emits the last chunk (the only one, header included, for an empty
  // payload). INTERNAL if the bytes fell short of the declared size.
  absl::Status Finish();
  uint64_t bytes_sent() const { return appended_; }

 private:
  absl::Status Emit();

  const LayerStateEmit& emit_;
  const size_t chunk_bytes_;
  const uint64_t declared_;
  uint64_t appended_ = 0;
  uint32_t crc_ = 0;
  bool broken_ = false;
  v1::LayerStateChunk chunk_;
};

// A checkpoint of `layer` of `job`'s model by `worker` at `step`: the
// layer's parameters' shapes in order, each followed by `state_per_param`
// optimizer tensors, all float32 zeros (coordinator tests; bench/swarm's
// stages).
v1::LayerCheckpoint ZeroLayerCheckpoint(const v1::JobSpec& job, const std::string& worker,
                                        int layer, int step, int state_per_param = 0);

// Calls `emit` with each chunk of `layer` in order (at least one chunk: the
// header, even for an empty payload). Stops early and returns false when
// `emit` does (a broken stream).
bool ForEachLayerStateChunk(const v1::LayerCheckpoint& layer, size_t chunk_bytes,
                            const LayerStateEmit& emit);

// Where a receiver puts what it checked. Begin is called once per layer
// before its bytes, End after the checksum matched; any error stops the
// stream.
class LayerStateSink {
 public:
  virtual ~LayerStateSink() = default;
  virtual absl::Status Begin(const v1::LayerCheckpoint& header, uint64_t payload_bytes) = 0;
  virtual absl::Status Append(absl::string_view data) = 0;
  virtual absl::Status End() = 0;
};

class LayerStateReceiver {
 public:
  // `sink` is not owned and must outlive the receiver. A layer declaring
  // more than `max_layer_bytes` of payload is refused before anything is
  // allocated.
  LayerStateReceiver(LayerStateSink* sink, uint64_t max_layer_bytes)
      : sink_(sink), max_layer_bytes_(max_layer_bytes) {}

  // INVALID_ARGUMENT for a chunk out of order or of the wrong size,
  // DATA_LOSS for a checksum that does not match; the sink's own errors as
  // they are.
  absl::Status Add(const v1::LayerStateChunk& chunk);
  // At the end of the stream: INVALID_ARGUMENT if a layer was cut short.
  absl::Status Finish() const;

  int layers_done() const { return layers_done_; }
  uint64_t payload_bytes_received() const { return bytes_total_; }

 private:
  LayerStateSink* sink_;
  const uint64_t max_layer_bytes_;
  bool in_layer_ = false;
  int layer_ = 0;
  uint64_t declared_ = 0;
  uint64_t received_ = 0;
  uint32_t crc_ = 0;
  int layers_done_ = 0;
  uint64_t bytes_total_ = 0;
};

// A sink that assembles whole layers in memory (a worker restoring them):
// the payload is reserved once at its declared size.
class LayerStateCollector : public LayerStateSink {
 public:
  absl::Status Begin(const v1::LayerCheckpoint& header, uint64_t payload_bytes) override;
  absl::Status Append(absl::string_view data) override;
  absl::Status End() override;

  std::vector<v1::LayerCheckpoint>& layers() { return layers_; }

 private:
  std::vector<v1::LayerCheckpoint> layers_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_LAYER_STATE_H_
