#include "common/layer_state.h"

#include <zlib.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/model_profile.h"
#include "common/status_macros.h"

namespace geotrain {

uint64_t MaxLayerStateBytes(const v1::JobSpec& job, int layer) {
  const std::vector<LayerProfile> layers = ProfileLayers(job);
  if (layer < 0 || layer >= static_cast<int>(layers.size())) return 0;
  // With pipelines, also the outer weights and momentum.
  return layers[layer].parameter_count * sizeof(float) * (job.has_outer() ? 5 : 3);
}

uint64_t MaxLayerWeightsBytes(const v1::JobSpec& job, int layer) {
  const std::vector<LayerProfile> layers = ProfileLayers(job);
  if (layer < 0 || layer >= static_cast<int>(layers.size())) return 0;
  return layers[layer].parameter_count * sizeof(float) * 2;
}

v1::LayerCheckpoint LayerStateHeader(const v1::LayerCheckpoint& layer) {
  v1::LayerCheckpoint header;
  header.set_worker_id(layer.worker_id());
  header.set_layer(layer.layer());
  header.set_step(layer.step());
  header.set_optimizer_steps(layer.optimizer_steps());
  header.set_state_per_param(layer.state_per_param());
  *header.mutable_params() = layer.params();
  *header.mutable_optimizer_state() = layer.optimizer_state();
  header.set_data_cursor(layer.data_cursor());
  *header.mutable_outer_weights() = layer.outer_weights();
  *header.mutable_outer_momentum() = layer.outer_momentum();
  header.set_outer_rounds(layer.outer_rounds());
  return header;
}

uint64_t DeclaredPayloadBytes(const v1::LayerCheckpoint& header) {
  uint64_t bytes = 0;
  for (const auto* tensors : {&header.params(), &header.optimizer_state(),
                              &header.outer_weights(), &header.outer_momentum()}) {
    for (const v1::TensorHeader& h : *tensors) {
      // Saturate rather than wrap: a forged header must not look small.
      bytes = h.payload_bytes() > UINT64_MAX - bytes ? UINT64_MAX : bytes + h.payload_bytes();
    }
  }
  return bytes;
}

uint32_t Crc32Update(uint32_t crc, absl::string_view data) {
  uLong value = crc;
  while (!data.empty()) {
    const size_t n = std::min<size_t>(data.size(), 1u << 30);
    value = crc32(value, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(n));
    data.remove_prefix(n);
  }
  return static_cast<uint32_t>(value);
}

LayerStateChunker::LayerStateChunker(const v1::LayerCheckpoint& header, uint64_t payload_bytes,
                                     const LayerStateEmit& emit, size_t chunk_bytes)
    : emit_(emit),
      chunk_bytes_(std::max<size_t>(4, chunk_bytes & ~size_t{3})),
      declared_(payload_bytes) {
  *chunk_.mutable_header() = LayerStateHeader(header);
  chunk_.set_payload_bytes(payload_bytes);
}

absl::Status LayerStateChunker::Emit() {
  if (broken_ || !emit_(chunk_)) {
    broken_ = true;
    return absl::CancelledError("the layer state stream broke");
  }
  chunk_.Clear();
  return absl::OkStatus();
}

absl::Status LayerStateChunker::Append(absl::string_view bytes) {
  if (broken_) return absl::CancelledError("the layer state stream broke");
  if (bytes.size() > declared_ - appended_) {
    return absl::InternalError(absl::StrCat("layer state past its declared ", declared_, " bytes"));
  }
  while (!bytes.empty()) {
    // A full chunk goes once more bytes follow it; the final one waits
    // for Finish() and its checksum.
    if (chunk_.data().size() == chunk_bytes_) RETURN_IF_ERROR(Emit());
    const absl::string_view piece = bytes.substr(0, chunk_bytes_ - chunk_.data().size());
    chunk_.mutable_data()->append(piece.data(), piece.size());
    crc_ = Crc32Update(crc_, piece);
    appended_ += piece.size();
    bytes.remove_prefix(piece.size());
  }
  return absl::OkStatus();
}

absl::Status LayerStateChunker::Finish() {
  if (broken_) return absl::CancelledError("the layer state stream broke");
  if (appended_ != declared_) {
    return absl::InternalError(absl::StrCat("layer state ended at byte ", appended_, " of ",
                                            declared_));
  }
  chunk_.set_last(true);
  chunk_.set_payload_crc32(crc_);
  return Emit();
}

bool ForEachLayerStateChunk(const v1::LayerCheckpoint& layer, size_t chunk_bytes,
                            const LayerStateEmit& emit) {
  LayerStateChunker chunker(layer, layer.payload().size(), emit, chunk_bytes);
  return chunker.Append(layer.payload()).ok() && chunker.Finish().ok();
}

absl::Status LayerStateReceiver::Add(const v1::LayerStateChunk& chunk) {
  if (!in_layer_) {
    if (!chunk.has_header()) {
      return absl::InvalidArgumentError("layer state chunk without a header where a layer begins");
    }
    const v1::LayerCheckpoint& header = chunk.header();
    if (!header.payload().empty()) {
      return absl::InvalidArgumentError("layer state header carries a payload of its own");
    }
    layer_ = header.layer();
    declared_ = chunk.payload_bytes();
    if (declared_ != DeclaredPayloadBytes(header)) {
      return absl::InvalidArgumentError(
          absl::StrCat("state of layer ", layer_, " declares ", declared_,
                       " payload bytes; its tensors need ", DeclaredPayloadBytes(header)));
    }
    if (declared_ > max_layer_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat("state of layer ", layer_, " of ", declared_,
                                                     " bytes; at most ", max_layer_bytes_,
                                                     " are accepted"));
    }
    received_ = 0;
    crc_ = 0;
    in_layer_ = true;
    if (absl::Status begun = sink_->Begin(header, declared_); !begun.ok()) return begun;
  } else if (chunk.has_header()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state of layer ", layer_, " interrupted by another layer's header"));
  }
  const std::string& data = chunk.data();
  if (data.size() > kLayerStateChunkBytes || data.size() % 4 != 0 ||
      data.size() > declared_ - received_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state of layer ", layer_, ": a chunk of ", data.size(), " bytes at offset ", received_,
        " of ", declared_, " (chunks are multiples of 4, at most ", kLayerStateChunkBytes, ")"));
  }
  if (!data.empty()) {
    crc_ = Crc32Update(crc_, data);
    received_ += data.size();
    bytes_total_ += data.size();
    if (absl::Status appended = sink_->Append(data); !appended.ok()) return appended;
  }
  if (!chunk.last()) return absl::OkStatus();
  if (received_ != declared_) {
    return absl::InvalidArgumentError(absl::StrCat("state of layer ", layer_, " ends after ",
                                                   received_, " of ", declared_, " bytes"));
  }
  if (chunk.payload_crc32() != crc_) {
    return absl::DataLossError(absl::StrCat("state of layer ", layer_,
                                            ": the payload's checksum does not match"));
  }
  in_layer_ = false;
  ++layers_done_;
  return sink_->End();
}

absl::Status LayerStateReceiver::Finish() const {
  if (in_layer_) {
    return absl::InvalidArgumentError(absl::StrCat("the stream ended inside the state of layer ",
                                                   layer_, " (", received_, " of ", declared_,
                                                   " bytes)"));
  }
  return absl::OkStatus();
}

absl::Status LayerStateCollector::Begin(const v1::LayerCheckpoint& header,
                                        uint64_t payload_bytes) {
  v1::LayerCheckpoint& layer = layers_.emplace_back(header);
  layer.mutable_payload()->reserve(payload_bytes);
  return absl::OkStatus();
}

absl::Status LayerStateCollector::Append(absl::string_view data) {
  layers_.back().mutable_payload()->append(data.data(), data.size());
  return absl::OkStatus();
}

absl::Status LayerStateCollector::End() { return absl::OkStatus(); }

v1::LayerCheckpoint ZeroLayerCheckpoint(const v1::JobSpec& job, const std::string& worker,
                                        int layer, int step, int state_per_param) {
  v1::LayerCheckpoint c;
  c.set_worker_id(worker);
  c.set_layer(layer);
  c.set_step(step);
  c.set_state_per_param(state_per_param);
  uint64_t bytes = 0;
  auto fill = [&bytes](v1::TensorHeader* h, const std::vector<int64_t>& shape) {
    h->set_dtype(v1::DTYPE_FLOAT32);
    h->set_codec(v1::CODEC_NONE);
    uint64_t n = 1;
    for (int64_t dim : shape) {
      h->add_shape(dim);
      n *= static_cast<uint64_t>(dim);
    }
    h->set_payload_bytes(4 * n);
    h->set_encoded_bytes(4 * n);
    bytes += 4 * n;
  };
  const std::vector<ParameterSpec> params = LayerParameters(job, layer);
  for (const ParameterSpec& p : params) fill(c.add_params(), p.shape);
  for (const ParameterSpec& p : params) {
    for (int k = 0; k < state_per_param; ++k) fill(c.add_optimizer_state(), p.shape);
  }
  c.mutable_payload()->assign(bytes, '\0');
  return c;
}

}  // namespace geotrain
