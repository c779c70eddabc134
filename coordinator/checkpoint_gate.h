// Who may save and load which stage checkpoints, in front of the
// CheckpointStore. It reads the plan (PlanView), the leases (Membership)
// and the committed progress (ProgressGate), each thread-safe itself, and
// holds no lock of its own: no checkpoint call waits for a plan decision,
// and none holds anything while the store reads or writes the disk.
//
// A worker saves only the layers of the stage it is the primary of, while
// its lease runs, at a step the pipeline has reached; it loads only its
// own stage's layers (PERMISSION_DENIED otherwise). A checkpoint must
// match the model (CheckLayerCheckpoint) or it is refused with an event.
// Loading records a restore event, and one for each corrupt file passed
// over. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_CHECKPOINT_GATE_H_
#define GEOTRAIN_COORDINATOR_CHECKPOINT_GATE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/event_log.h"
#include "coordinator/membership.h"
#include "coordinator/plan_view.h"
#include "coordinator/progress_gate.h"
#include "geotrain/v1/job.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct CheckpointGateOptions {
  const v1::JobSpec* job = nullptr;  // none owned; all must outlive the gate
  CheckpointStore* store = nullptr;
  const PlanView* plan = nullptr;
  const Membership* membership = nullptr;
  const ProgressGate* progress = nullptr;
  EventLog* events = nullptr;
  // How far past the progress a checkpoint's step may be (stage 0 may
  // lead the committed step by the steps in flight).
  int lead_steps = 0;
};

class CheckpointGate {
 public:
  explicit CheckpointGate(CheckpointGateOptions options) : options_(options) {}

  // Streaming (the RPCs; coordinator/checkpoint_upload.h): Authorize checks
  // the uploader and the header before any payload arrives; RecordRefused
  // logs a refusal found later (a value that is not finite); Open opens
  // the newest intact file for a restore.
  absl::Status Authorize(const std::string& worker_id, const v1::LayerCheckpoint& header,
                         uint64_t payload_bytes);
  void RecordRefused(const std::string& worker_id, const std::string& why);
  // `step`: that step's file (a rollback's restore), not the newest.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& worker_id,
                                                         int layer,
                                                         std::optional<int> step = std::nullopt);
  // Whole-layer forms (tests, tools). With `probe`, Load returns only the
  // newest step (from the index, no tensors, no event).
  absl::Status Save(const v1::LayerCheckpoint& checkpoint);
  absl::StatusOr<v1::LayerCheckpoint> Load(const std::string& worker_id, int layer,
                                           bool probe = false);

  // Model state that crossed the coordinator's own network interface
  // (status: state_traffic).
  void CountReceived(uint64_t payload_bytes);
  void CountSent(uint64_t payload_bytes);
  void FillTraffic(v1::StateTraffic* traffic) const;

 private:
  // PERMISSION_DENIED unless the plan puts `layer` on `worker_id`'s stage.
  absl::Status CheckOwnLayer(const std::string& worker_id, int layer) const;

  const CheckpointGateOptions options_;
  std::atomic<uint64_t> bytes_received_{0}, bytes_sent_{0};
  std::atomic<uint64_t> layers_received_{0}, layers_sent_{0};
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_CHECKPOINT_GATE_H_
