#include "worker/stage_state_server.h"

#include "absl/strings/str_cat.h"
#include "common/layer_state.h"
#include "common/rpc_options.h"
#include "worker/coordinator_client.h"

namespace geotrain {
namespace {

grpc::Status Refuse(grpc::StatusCode code, const std::string& why) {
  return grpc::Status(code, why);
}

}  // namespace

void StageStateServer::UseSecurity(const TransportSecurity& security) {
  absl::MutexLock lock(&mu_);
  insecure_ = security.insecure;
}

void StageStateServer::Offer(uint64_t epoch, int layer_begin, int layer_end,
                             std::vector<std::string> for_workers,
                             std::vector<v1::LayerCheckpoint> layers) {
  auto offer = std::make_unique<Offered>();
  offer->epoch = epoch;
  offer->layer_begin = layer_begin;
  offer->layer_end = layer_end;
  offer->waiting.insert(for_workers.begin(), for_workers.end());
  offer->layers = std::make_shared<const std::vector<v1::LayerCheckpoint>>(std::move(layers));
  absl::MutexLock lock(&mu_);
  offer_ = std::move(offer);
}

void StageStateServer::Withdraw() {
  absl::MutexLock lock(&mu_);
  offer_.reset();
}

StageStateServer::Counters StageStateServer::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

grpc::Status StageStateServer::FetchLayerState(grpc::ServerContext* context,
                                               const v1::FetchLayerStateRequest* request,
                                               grpc::ServerWriter<v1::LayerStateChunk>* writer) {
  std::shared_ptr<const std::vector<v1::LayerCheckpoint>> layers;
  std::string caller;
  {
    absl::MutexLock lock(&mu_);
    caller = insecure_ ? request->worker_id() : PeerIdentity(*context);
    if (!insecure_ && caller != request->worker_id()) {
      return Refuse(grpc::StatusCode::PERMISSION_DENIED,
                    absl::StrCat("a request for '", request->worker_id().substr(0, 128),
                                 "' from a peer whose certificate names '", caller, "'"));
    }
    auto offered = [this, request]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return offer_ != nullptr && offer_->epoch >= request->epoch();
    };
    if (!offered()) {
      if (waits_[caller] >= kMaxWaitsPerCaller || waits_total_ >= kMaxWaits) {
        if (waits_[caller] == 0) waits_.erase(caller);
        return Refuse(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat("too many state fetches waiting for an offer (",
                                   kMaxWaitsPerCaller, " per caller, ", kMaxWaits, " in all)"));
      }
      ++waits_[caller];
      ++waits_total_;
      mu_.AwaitWithTimeout(absl::Condition(&offered), wait_for_offer_);
      --waits_total_;
      if (--waits_[caller] == 0) waits_.erase(caller);
    }
    if (offer_ == nullptr || offer_->epoch != request->epoch()) {
      return Refuse(grpc::StatusCode::FAILED_PRECONDITION,
                    absl::StrCat("no state offered for plan epoch ", request->epoch()));
    }
    if (offer_->waiting.count(caller) == 0) {
      return Refuse(grpc::StatusCode::PERMISSION_DENIED,
                    absl::StrCat("the plan of epoch ", request->epoch(), " does not send '",
                                 caller.substr(0, 128), "' here for its state (or it has it)"));
    }
    if (request->layer_begin() != offer_->layer_begin ||
        request->layer_end() != offer_->layer_end) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("layers [", request->layer_begin(), ",", request->layer_end(),
                                 ") asked; this worker offers [", offer_->layer_begin, ",",
                                 offer_->layer_end, ")"));
    }
    layers = offer_->layers;
  }
  int64_t bytes = 0;
  for (const v1::LayerCheckpoint& layer : *layers) {
    const bool sent = ForEachLayerStateChunk(
        layer, kLayerStateChunkBytes,
        [writer](const v1::LayerStateChunk& chunk) { return writer->Write(chunk); });
    if (!sent) return Refuse(grpc::StatusCode::CANCELLED, "the newcomer went away");
    bytes += static_cast<int64_t>(layer.payload().size());
  }
  absl::MutexLock lock(&mu_);
  counters_.layers_served += static_cast<int64_t>(layers->size());
  counters_.bytes_served += bytes;
  if (offer_ != nullptr && offer_->layers == layers) {
    offer_->waiting.erase(caller);
    if (offer_->waiting.empty()) offer_.reset();  // everyone has it: free the snapshot
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::vector<v1::LayerCheckpoint>> FetchStageState(
    const std::string& address, const std::string& holder_id, const TransportSecurity& security,
    const v1::FetchLayerStateRequest& request, uint64_t max_layer_bytes, absl::Duration deadline) {
  auto stub = v1::StageState::NewStub(MakeSecureChannel(address, security, holder_id));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  std::unique_ptr<grpc::ClientReader<v1::LayerStateChunk>> reader =
      stub->FetchLayerState(&context, request);
  absl::StatusOr<std::vector<v1::LayerCheckpoint>> layers =
      ReceiveLayerStates(*reader, max_layer_bytes);
  if (!layers.ok()) return layers;
  if (static_cast<int>(layers->size()) != request.layer_end() - request.layer_begin()) {
    return absl::InvalidArgumentError(absl::StrCat("the holder sent ", layers->size(),
                                                   " layers for [", request.layer_begin(), ",",
                                                   request.layer_end(), ")"));
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    if ((*layers)[i].layer() != request.layer_begin() + static_cast<int>(i)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the holder sent layer ", (*layers)[i].layer(), " out of order"));
    }
  }
  return layers;
}

}  // namespace geotrain
