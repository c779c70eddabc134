#include "coordinator/checkpoint_upload.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace geotrain {

absl::Status CheckpointUpload::Begin(const v1::LayerCheckpoint& header, uint64_t payload_bytes) {
  if (!header.worker_id().empty() && header.worker_id() != worker_id_) {
    return absl::PermissionDeniedError(absl::StrCat("worker ", worker_id_.substr(0, 128),
                                                    " uploads a checkpoint for ",
                                                    header.worker_id().substr(0, 128)));
  }
  v1::LayerCheckpoint checked = header;
  checked.set_worker_id(worker_id_);
  RETURN_IF_ERROR(controller_->checkpoint_gate().Authorize(worker_id_, checked, payload_bytes));
  what_ = absl::StrCat("checkpoint of layer ", header.layer(), " at step ", header.step());
  payload_bytes_ = payload_bytes;
  ASSIGN_OR_RETURN(writer_, controller_->checkpoints().BeginSave(checked, payload_bytes));
  return absl::OkStatus();
}

absl::Status CheckpointUpload::Append(absl::string_view data) {
  if (absl::Status finite = CheckFiniteFloats(data, what_); !finite.ok()) {
    controller_->checkpoint_gate().RecordRefused(worker_id_, std::string(finite.message()));
    writer_.reset();  // nothing of the layer is kept
    return finite;
  }
  return writer_->Append(data);
}

absl::Status CheckpointUpload::End() {
  RETURN_IF_ERROR(writer_->Commit());
  writer_.reset();
  controller_->checkpoint_gate().CountReceived(payload_bytes_);
  return absl::OkStatus();
}

absl::Status SendCheckpoint(JobController& controller, const std::string& worker_id, int layer,
                            std::optional<int> step,
                            const std::function<bool(const v1::LayerStateChunk&)>& emit) {
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                   controller.checkpoint_gate().Open(worker_id, layer, step));
  LayerStateChunker chunker(reader->header(), reader->payload_bytes(), emit);
  std::string piece;
  while (chunker.bytes_sent() < reader->payload_bytes()) {
    piece.clear();
    ASSIGN_OR_RETURN(const size_t n, reader->Read(kLayerStateChunkBytes, &piece));
    if (n == 0) return absl::DataLossError("the checkpoint file ended early");
    RETURN_IF_ERROR(chunker.Append(piece));
  }
  RETURN_IF_ERROR(chunker.Finish());
  const uint64_t sent = chunker.bytes_sent();
  controller.checkpoint_gate().CountSent(sent);
  return absl::OkStatus();
}

}  // namespace geotrain
