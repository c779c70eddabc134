#include "worker/replica_averager.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/rpc_options.h"

namespace geotrain {
namespace {

// Messages stay well under the 16 MiB gRPC limit (rpc_options.h); a stage
// larger than this goes as several pushes of whole layers.
constexpr size_t kMaxPushBytes = 12 << 20;

grpc::Status Refuse(grpc::StatusCode code, const std::string& why) {
  GT_LOG(Warning) << "refused replica weights: " << why;
  return grpc::Status(code, why);
}

}  // namespace

ReplicaAverager::ReplicaAverager(absl::Duration push_deadline)
    : push_deadline_(push_deadline), sender_([this] { SendLoop(); }) {}

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
  pending_.clear();
}

void ReplicaAverager::Deactivate() {
  absl::MutexLock lock(&mu_);
  target_.reset();
  received_.clear();
  pending_.clear();
}

void ReplicaAverager::Push(int step, std::vector<v1::LayerWeights> layers, bool catching_up) {
  absl::MutexLock lock(&mu_);
  if (!target_.has_value() || target_->peers.empty()) return;
  pending_.clear();
  size_t bytes = 0;
  for (v1::LayerWeights& layer : layers) {
    if (pending_.empty() || bytes + layer.payload().size() > kMaxPushBytes) {
      v1::ReplicaWeights& message = pending_.emplace_back();
      message.set_epoch(target_->epoch);
      message.set_stage(target_->stage);
      message.set_from_worker(target_->self_id);
      message.set_step(step);
      message.set_catching_up(catching_up);
      bytes = 0;
    }
    bytes += layer.payload().size();
    *pending_.back().add_layers() = std::move(layer);
  }
  pending_peers_ = target_->peers;
}

ReplicaAverager::Received ReplicaAverager::TakeReceived(bool catching_up) {
  absl::MutexLock lock(&mu_);
  Received out;
  if (!target_.has_value()) return out;
  const size_t stage_layers = static_cast<size_t>(target_->layer_end - target_->layer_begin);
  std::vector<std::string> complete;
  bool from_established = false;
  for (const auto& [peer, push] : received_) {
    if (push.layers.size() != stage_layers) continue;  // parts still on the way
    complete.push_back(peer);
    from_established = from_established || !push.catching_up;
  }
  // A newcomer adopts what established siblings sent; an established
  // replica ignores newcomers; otherwise everything is averaged.
  out.adopt = catching_up && from_established;
  for (const std::string& peer : complete) {
    PeerPush& push = received_[peer];
    if (!push.catching_up || (catching_up && !out.adopt)) {
      for (auto& [layer, weights] : push.layers) out.layers.push_back(std::move(weights));
    }
    received_.erase(peer);
  }
  return out;
}

ReplicaAverager::Counters ReplicaAverager::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

grpc::Status ReplicaAverager::PushWeights(grpc::ServerContext* context,
                                          const v1::ReplicaWeights* request,
                                          v1::PushWeightsResponse* response) {
  absl::MutexLock lock(&mu_);
  if (!target_.has_value()) {
    return Refuse(grpc::StatusCode::FAILED_PRECONDITION, "this worker has no replicated stage");
  }
  const Target& target = *target_;
  if (request->epoch() != target.epoch || request->stage() != target.stage) {
    return Refuse(grpc::StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("weights of epoch ", request->epoch(), " stage ",
                               request->stage(), "; this worker runs epoch ", target.epoch,
                               " stage ", target.stage));
  }
  if (!security_.insecure && PeerIdentity(*context) != request->from_worker()) {
    return Refuse(grpc::StatusCode::PERMISSION_DENIED,
                  absl::StrCat("weights from '", request->from_worker().substr(0, 128),
                               "' pushed by a peer whose certificate names '",
                               PeerIdentity(*context), "'"));
  }
  bool known = false;
  for (const Peer& peer : target.peers) known = known || peer.worker_id == request->from_worker();
  if (!known) {
    return Refuse(grpc::StatusCode::PERMISSION_DENIED,
                  absl::StrCat("'", request->from_worker(), "' is not a replica of stage ",
                               target.stage, " in epoch ", target.epoch));
  }
  for (const v1::LayerWeights& layer : request->layers()) {
    if (layer.layer() < target.layer_begin || layer.layer() >= target.layer_end) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("layer ", layer.layer(), " is not in stage ", target.stage,
                                 " [", target.layer_begin, ",", target.layer_end, ")"));
    }
    uint64_t bytes = 0;
    for (const v1::TensorHeader& t : layer.params()) bytes += t.payload_bytes();
    if (bytes != layer.payload().size()) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("layer ", layer.layer(), ": headers describe ", bytes,
                                 " bytes, the payload has ", layer.payload().size()));
    }
  }
  // Shapes, codecs and values are checked when the runtime decodes them.
  PeerPush& push = received_[request->from_worker()];
  if (push.step != request->step()) push = PeerPush{request->step(), request->catching_up(), {}};
  for (const v1::LayerWeights& layer : request->layers()) push.layers[layer.layer()] = layer;
  ++counters_.pushes_received;
  return grpc::Status::OK;
}

void ReplicaAverager::SendLoop() {
  while (true) {
    std::vector<v1::ReplicaWeights> messages;
    std::vector<Peer> peers;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !pending_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      messages.swap(pending_);
      peers = pending_peers_;
    }
    for (const Peer& peer : peers) {
      auto& stub = stubs_[peer.address];
      if (stub == nullptr) {
        stub = v1::ReplicaSync::NewStub(
            MakeSecureChannel(peer.address, security_, peer.worker_id));
      }
      for (const v1::ReplicaWeights& message : messages) {
        grpc::ClientContext context;
        context.set_deadline(DeadlineFromNow(
            std::chrono::milliseconds(absl::ToInt64Milliseconds(push_deadline_))));
        v1::PushWeightsResponse response;
        const grpc::Status status = stub->PushWeights(&context, message, &response);
        absl::MutexLock lock(&mu_);
        if (status.ok()) {
          ++counters_.pushes_sent;
          continue;
        }
        ++counters_.pushes_failed;
        GT_LOG(Warning) << "pushing weights to replica " << peer.worker_id << " at "
                        << peer.address << " failed: " << status.error_message();
        break;  // the rest of this push would fail the same way
      }
    }
  }
}

}  // namespace geotrain
