#include "worker/replica_averager.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/rpc_options.h"

namespace geotrain {
namespace {

grpc::Status Refuse(grpc::StatusCode code, const std::string& why) {
  GT_LOG(Warning) << "refused replica weights: " << why;
  return grpc::Status(code, why);
}

}  // namespace

ReplicaAverager::ReplicaAverager(absl::Duration push_deadline, double min_push_bytes_per_second)
    : push_deadline_(push_deadline),
      min_push_bytes_per_second_(min_push_bytes_per_second),
      sender_([this] { SendLoop(); }) {}

ReplicaAverager::~ReplicaAverager() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  sender_.join();
}

void ReplicaAverager::Activate(Target target) {
  absl::MutexLock lock(&mu_);
  target_ = std::move(target);
  received_.clear();
  pending_.reset();
}

void ReplicaAverager::Deactivate() {
  absl::MutexLock lock(&mu_);
  target_.reset();
  received_.clear();
  pending_.reset();
}

void ReplicaAverager::Push(int step, std::vector<v1::LayerWeights> layers, bool catching_up) {
  absl::MutexLock lock(&mu_);
  if (!target_.has_value() || target_->peers.empty()) return;
  pending_ = PendingPush{step, catching_up, *target_, std::move(layers)};
}

ReplicaAverager::Received ReplicaAverager::TakeReceived(bool catching_up) {
  absl::MutexLock lock(&mu_);
  Received out;
  if (!target_.has_value()) return out;
  bool from_established = false;
  for (const auto& [peer, push] : received_) from_established |= !push.catching_up;
  // A newcomer adopts what established siblings sent; an established
  // replica ignores newcomers; otherwise everything is averaged.
  out.adopt = catching_up && from_established;
  for (auto& [peer, push] : received_) {
    if (!push.catching_up || (catching_up && !out.adopt)) {
      for (auto& [layer, weights] : push.layers) out.layers.push_back(std::move(weights));
    }
  }
  received_.clear();
  return out;
}

ReplicaAverager::Counters ReplicaAverager::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

grpc::Status ReplicaAverager::AddParts(const Target& target, const v1::ReplicaWeights& message,
                                       const v1::ReplicaWeights& first, PeerPush& push,
                                       std::map<int, uint64_t>& declared) {
  if (message.epoch() != first.epoch() || message.stage() != first.stage() ||
      message.from_worker() != first.from_worker() || message.step() != first.step() ||
      message.catching_up() != first.catching_up()) {
    return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                  "a message of the push names another epoch, stage, sender or step than its "
                  "first");
  }
  for (const v1::LayerWeights& part : message.layers()) {
    if (part.layer() < target.layer_begin || part.layer() >= target.layer_end) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("layer ", part.layer(), " is not in stage ", target.stage,
                                 " [", target.layer_begin, ",", target.layer_end, ")"));
    }
    auto it = push.layers.find(part.layer());
    if (it == push.layers.end()) {
      if (part.payload_offset() != 0) {
        return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("layer ", part.layer(), ": the first part starts at byte ",
                                   part.payload_offset(), ", not 0"));
      }
      uint64_t bytes = 0;
      for (const v1::TensorHeader& t : part.params()) {
        bytes += std::min<uint64_t>(t.payload_bytes(), target.max_layer_bytes + 1);
      }
      if (bytes > target.max_layer_bytes) {
        return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("layer ", part.layer(), ": headers declare more than ",
                                   target.max_layer_bytes, " bytes, more than the layer can hold"));
      }
      declared[part.layer()] = bytes;
      it = push.layers.emplace(part.layer(), v1::LayerWeights()).first;
      it->second.set_layer(part.layer());
      *it->second.mutable_params() = part.params();
      it->second.mutable_payload()->reserve(bytes);  // bounded above, by the model
    } else if (part.params_size() != 0 || part.payload_offset() != it->second.payload().size()) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("layer ", part.layer(), ": a part at byte ",
                                 part.payload_offset(), " (with ", part.params_size(),
                                 " headers) where byte ", it->second.payload().size(),
                                 " was due"));
    }
    std::string& payload = *it->second.mutable_payload();
    if (payload.size() + part.payload().size() > declared[part.layer()]) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("layer ", part.layer(), ": headers describe ",
                                 declared[part.layer()], " bytes, the parts hold more"));
    }
    payload.append(part.payload());
  }
  return grpc::Status::OK;
}

grpc::Status ReplicaAverager::PushWeights(grpc::ServerContext* context,
                                          grpc::ServerReader<v1::ReplicaWeights>* reader,
                                          v1::PushWeightsResponse* response) {
  v1::ReplicaWeights first;
  if (!reader->Read(&first)) {
    return Refuse(grpc::StatusCode::INVALID_ARGUMENT, "an empty push");
  }
  Target target;
  {
    absl::MutexLock lock(&mu_);
    if (!target_.has_value()) {
      return Refuse(grpc::StatusCode::FAILED_PRECONDITION, "this worker has no replicated stage");
    }
    target = *target_;
  }
  if (first.epoch() != target.epoch || first.stage() != target.stage) {
    return Refuse(grpc::StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("weights of epoch ", first.epoch(), " stage ", first.stage(),
                               "; this worker runs epoch ", target.epoch, " stage ",
                               target.stage));
  }
  if (!security_.insecure && PeerIdentity(*context) != first.from_worker()) {
    return Refuse(grpc::StatusCode::PERMISSION_DENIED,
                  absl::StrCat("weights from '", first.from_worker().substr(0, 128),
                               "' pushed by a peer whose certificate names '",
                               PeerIdentity(*context), "'"));
  }
  bool known = false;
  for (const Peer& peer : target.peers) known = known || peer.worker_id == first.from_worker();
  if (!known) {
    return Refuse(grpc::StatusCode::PERMISSION_DENIED,
                  absl::StrCat("'", first.from_worker().substr(0, 128),
                               "' is not a replica of stage ", target.stage, " in epoch ",
                               target.epoch));
  }
  {
    absl::MutexLock lock(&mu_);
    if (!receiving_.insert(first.from_worker()).second) {
      return Refuse(grpc::StatusCode::RESOURCE_EXHAUSTED,
                    absl::StrCat("a push from '", first.from_worker().substr(0, 128),
                                 "' is arriving already"));
    }
  }
  struct Done {
    ReplicaAverager* self;
    std::string from;
    ~Done() {
      absl::MutexLock lock(&self->mu_);
      self->receiving_.erase(from);
    }
  } done{this, first.from_worker()};
  // Assembled apart from what the driver may take, and kept only whole.
  PeerPush push{first.step(), first.catching_up(), {}};
  std::map<int, uint64_t> declared;
  v1::ReplicaWeights message = first;
  do {
    const grpc::Status added = AddParts(target, message, first, push, declared);
    if (!added.ok()) return added;
  } while (reader->Read(&message));
  for (int layer = target.layer_begin; layer < target.layer_end; ++layer) {
    auto it = push.layers.find(layer);
    if (it == push.layers.end()) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("the push ended without layer ", layer));
    }
    if (it->second.payload().size() != declared[layer]) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("the push ended before layer ", layer, " was complete (",
                                 it->second.payload().size(), " of ", declared[layer],
                                 " bytes)"));
    }
  }
  // Shapes, codecs and values are checked when the runtime decodes them.
  absl::MutexLock lock(&mu_);
  if (!target_.has_value() || target_->epoch != target.epoch) {
    return Refuse(grpc::StatusCode::FAILED_PRECONDITION,
                  "the plan changed while the push was arriving");
  }
  received_[first.from_worker()] = std::move(push);
  ++counters_.pushes_received;
  return grpc::Status::OK;
}

bool ReplicaAverager::SendPush(v1::ReplicaSync::Stub& stub, int step, bool catching_up,
                               const Target& target, const std::vector<v1::LayerWeights>& layers,
                               std::string* error) {
  uint64_t total = 0;
  for (const v1::LayerWeights& layer : layers) total += layer.payload().size();
  grpc::ClientContext context;
  const absl::Duration deadline =
      push_deadline_ + absl::Seconds(static_cast<double>(total) / min_push_bytes_per_second_);
  context.set_deadline(
      DeadlineFromNow(std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline))));
  v1::PushWeightsResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::ReplicaWeights>> writer =
      stub.PushWeights(&context, &response);
  v1::ReplicaWeights message;
  size_t message_bytes = 0;
  auto start_message = [&] {
    message.Clear();
    message.set_epoch(target.epoch);
    message.set_stage(target.stage);
    message.set_from_worker(target.self_id);
    message.set_step(step);
    message.set_catching_up(catching_up);
    message_bytes = 0;
  };
  bool written = true;
  start_message();
  for (const v1::LayerWeights& layer : layers) {
    const std::string& payload = layer.payload();
    size_t offset = 0;
    do {  // at least one part, which carries the headers
      if (message_bytes == kStreamPartBytes) {
        written = written && writer->Write(message);
        start_message();
      }
      const size_t take = std::min(payload.size() - offset, kStreamPartBytes - message_bytes);
      v1::LayerWeights& part = *message.add_layers();
      part.set_layer(layer.layer());
      if (offset == 0) *part.mutable_params() = layer.params();
      part.set_payload_offset(offset);
      part.set_payload(payload.substr(offset, take));
      offset += take;
      message_bytes += take;
    } while (offset < payload.size() && written);
    if (!written) break;
  }
  if (written && message.layers_size() > 0) written = writer->Write(message);
  if (written) writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) *error = status.error_message();
  return status.ok();
}

void ReplicaAverager::SendLoop() {
  while (true) {
    PendingPush push;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || pending_.has_value();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      push = std::move(*pending_);
      pending_.reset();
    }
    for (const Peer& peer : push.target.peers) {
      auto& stub = stubs_[peer.address];
      if (stub == nullptr) {
        stub = v1::ReplicaSync::NewStub(
            MakeSecureChannel(peer.address, security_, peer.worker_id));
      }
      std::string error;
      const bool sent = SendPush(*stub, push.step, push.catching_up, push.target, push.layers,
                                 &error);
      absl::MutexLock lock(&mu_);
      if (sent) {
        ++counters_.pushes_sent;
        continue;
      }
      ++counters_.pushes_failed;
      GT_LOG(Warning) << "pushing weights to replica " << peer.worker_id << " at "
                      << peer.address << " failed: " << error;
    }
  }
}

}  // namespace geotrain
