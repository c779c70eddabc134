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
  RETURN_IF_ERROR(controller_->AuthorizeCheckpoint(worker_id_, checked, payload_bytes));
  what_ = absl::StrCat("checkpoint of layer ", header.layer(), " at step ", header.step());
  payload_bytes_ = payload_bytes;
  ASSIGN_OR_RETURN(writer_, controller_->checkpoints().BeginSave(checked, payload_bytes));
  return absl::OkStatus();
}

absl::Status CheckpointUpload::Append(absl::string_view data) {
  if (absl::Status finite = CheckFiniteFloats(data, what_); !finite.ok()) {
    controller_->RecordCheckpointRefused(worker_id_, std::string(finite.message()));
    writer_.reset();  // nothing of the layer is kept
    return finite;
  }
  return writer_->Append(data);
}

absl::Status CheckpointUpload::End() {
  RETURN_IF_ERROR(writer_->Commit());
  writer_.reset();
  controller_->CountStateReceived(payload_bytes_);
  return absl::OkStatus();
}

absl::Status SendCheckpoint(JobController& controller, const std::string& worker_id, int layer,
                            const std::function<bool(const v1::LayerStateChunk&)>& emit) {
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                   controller.OpenCheckpoint(worker_id, layer));
  uint32_t crc = 0;
  uint64_t sent = 0;
  bool first = true;
  do {
    v1::LayerStateChunk chunk;
    if (first) {
      *chunk.mutable_header() = reader->header();
      chunk.set_payload_bytes(reader->payload_bytes());
      first = false;
    }
    ASSIGN_OR_RETURN(size_t n, reader->Read(kLayerStateChunkBytes, chunk.mutable_data()));
    crc = Crc32Update(crc, chunk.data());
    sent += n;
    if (sent == reader->payload_bytes()) {
      chunk.set_last(true);
      chunk.set_payload_crc32(crc);
    }
    if (!emit(chunk)) return absl::CancelledError("the restore stream broke");
  } while (sent < reader->payload_bytes());
  controller.CountStateSent(sent);
  return absl::OkStatus();
}

}  // namespace geotrain
