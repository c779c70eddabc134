#include "coordinator/checkpoint_gate.h"

#include <algorithm>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/layer_state.h"
#include "common/plan_util.h"
#include "common/status_macros.h"

namespace geotrain {

absl::Status CheckpointGate::CheckOwnLayer(const std::string& worker_id, int layer) const {
  const PlanView::PlanPtr plan = options_.plan->Get();
  const v1::StageAssignment* stage = plan != nullptr ? StageOf(*plan, worker_id) : nullptr;
  if (stage == nullptr || layer < stage->layer_begin() || layer >= stage->layer_end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        worker_id.substr(0, 128), " may load only the layers of its own stage, not ", layer));
  }
  return absl::OkStatus();
}

absl::Status CheckpointGate::Authorize(const std::string& worker_id,
                                       const v1::LayerCheckpoint& header,
                                       uint64_t payload_bytes) {
  absl::Status valid;
  const PlanView::PlanPtr plan = options_.plan->Get();
  const v1::StageAssignment* stage = plan != nullptr ? StageOf(*plan, worker_id) : nullptr;
  if (stage == nullptr || stage->worker_id() != worker_id ||
      header.layer() < stage->layer_begin() || header.layer() >= stage->layer_end()) {
    valid = absl::PermissionDeniedError(absl::StrCat(
        "checkpoint of layer ", header.layer(), " from ", worker_id.substr(0, 128),
        ", which is not the primary of the stage that holds it"));
  } else if (!options_.membership->IsLive(worker_id)) {
    valid = absl::PermissionDeniedError(absl::StrCat(
        "checkpoint from ", worker_id.substr(0, 128), ", whose lease has ended"));
  }
  if (valid.ok()) valid = CheckLayerCheckpointHeader(*options_.job, header, payload_bytes);
  if (valid.ok()) {
    // A checkpoint is of a step the pipeline has reached: one from the
    // future would be restored in place of every honest one after it.
    const int seen =
        std::max(options_.progress->committed_step(), options_.progress->claimed_step());
    if (header.step() > seen + options_.lead_steps) {
      valid = absl::FailedPreconditionError(absl::StrCat(
          "checkpoint of layer ", header.layer(), " at step ", header.step(),
          ": the job has reached step ", seen));
    }
  }
  if (!valid.ok()) RecordRefused(worker_id, std::string(valid.message()));
  return valid;
}

void CheckpointGate::RecordRefused(const std::string& worker_id, const std::string& why) {
  options_.events->Add("checkpoint_refused", options_.membership->NameOf(worker_id), why);
}

absl::Status CheckpointGate::Save(const v1::LayerCheckpoint& checkpoint) {
  RETURN_IF_ERROR(Authorize(checkpoint.worker_id(), LayerStateHeader(checkpoint),
                            checkpoint.payload().size()));
  // The content check reads every value (megabytes).
  if (absl::Status finite = CheckLayerCheckpoint(*options_.job, checkpoint); !finite.ok()) {
    RecordRefused(checkpoint.worker_id(), std::string(finite.message()));
    return finite;
  }
  return options_.store->Save(checkpoint);
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointGate::Open(
    const std::string& worker_id, int layer, std::optional<int> step) {
  RETURN_IF_ERROR(CheckOwnLayer(worker_id, layer));
  std::vector<std::string> skipped;
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      step.has_value() ? options_.store->Open(layer, *step)
                       : options_.store->OpenLatest(layer, &skipped);
  for (const std::string& why : skipped) {
    options_.events->Add("checkpoint_corrupt", "", absl::StrCat(why, "; using an older one"));
  }
  if (reader.ok()) {
    options_.events->Add("restore", options_.membership->NameOf(worker_id),
                         absl::StrCat("layer ", layer, " from step ",
                                      (*reader)->header().step()));
  }
  return reader;
}

absl::StatusOr<v1::LayerCheckpoint> CheckpointGate::Load(const std::string& worker_id,
                                                         int layer, bool probe) {
  if (probe) {
    RETURN_IF_ERROR(CheckOwnLayer(worker_id, layer));
    const std::map<int, std::vector<int>> index = options_.store->Index();
    auto it = index.find(layer);
    if (it == index.end() || it->second.empty()) {
      return absl::NotFoundError(absl::StrCat("no checkpoint of layer ", layer));
    }
    v1::LayerCheckpoint newest;
    newest.set_layer(layer);
    newest.set_step(it->second.back());
    return newest;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, Open(worker_id, layer));
  v1::LayerCheckpoint checkpoint = reader->header();
  while (true) {
    ASSIGN_OR_RETURN(size_t n, reader->Read(16 << 20, checkpoint.mutable_payload()));
    if (n == 0) break;
  }
  return checkpoint;
}

void CheckpointGate::CountReceived(uint64_t payload_bytes) {
  bytes_received_ += payload_bytes;
  ++layers_received_;
}

void CheckpointGate::CountSent(uint64_t payload_bytes) {
  bytes_sent_ += payload_bytes;
  ++layers_sent_;
}

void CheckpointGate::FillTraffic(v1::StateTraffic* traffic) const {
  traffic->set_checkpoint_bytes_received(bytes_received_);
  traffic->set_checkpoint_bytes_sent(bytes_sent_);
  traffic->set_layers_received(layers_received_);
  traffic->set_layers_sent(layers_sent_);
}

}  // namespace geotrain
