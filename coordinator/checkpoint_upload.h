// The coordinator's end of a checkpoint upload: a LayerStateSink that
// checks each layer's header with the JobController before a byte of it is
// stored, checks every value as it arrives, and streams the layer into the
// CheckpointStore, so the coordinator holds about one chunk, never a layer.
// One per SaveCheckpoint stream; not thread-safe.
#ifndef GEOTRAIN_COORDINATOR_CHECKPOINT_UPLOAD_H_
#define GEOTRAIN_COORDINATOR_CHECKPOINT_UPLOAD_H_

#include <memory>
#include <optional>
#include <string>

#include "common/layer_state.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/job_controller.h"

namespace geotrain {

class CheckpointUpload : public LayerStateSink {
 public:
  // `controller` is not owned. `worker_id` is the uploader as the transport
  // established it; a header naming another worker is refused.
  CheckpointUpload(JobController* controller, std::string worker_id)
      : controller_(controller), worker_id_(std::move(worker_id)) {}

  absl::Status Begin(const v1::LayerCheckpoint& header, uint64_t payload_bytes) override;
  absl::Status Append(absl::string_view data) override;
  absl::Status End() override;

 private:
  JobController* const controller_;
  const std::string worker_id_;
  std::string what_;  // "checkpoint of layer L at step S"
  uint64_t payload_bytes_ = 0;
  std::unique_ptr<CheckpointWriter> writer_;
};

// Streams the newest intact checkpoint of `layer` to `emit` in chunks for
// `worker_id` (CheckpointGate::Open decides whether it may have
// it). False from `emit` (the stream broke) is CANCELLED.
absl::Status SendCheckpoint(JobController& controller, const std::string& worker_id, int layer,
                            std::optional<int> step,
                            const std::function<bool(const v1::LayerStateChunk&)>& emit);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_CHECKPOINT_UPLOAD_H_
