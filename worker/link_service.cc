#include "worker/link_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/stage_probe.h"
#include "worker/link_hello.h"
#include "worker/stall_watchdog.h"

namespace geotrain {

namespace {

// What Measure replies may send in all (MeasureRequest.reply_bytes): an
// access measurement takes 256 KiB from each of a few peers, now and then.
constexpr uint64_t kMeasureReplyBudgetBytes = uint64_t{8} << 20;
constexpr absl::Duration kMeasureReplyWindow = absl::Seconds(10);

absl::Status Refusal(absl::StatusCode code, const std::string& peer, absl::string_view reason) {
  GT_LOG(Warning) << "refused link from " << peer << ": " << reason;
  return absl::Status(code, reason);
}

}  // namespace

LinkService::LinkService(LinkOptions options) : options_(std::move(options)) {
  // Link is the Stage service's first method (stage.proto); its handler
  // becomes one on raw bytes, as the generated one would be on LinkFrames.
  MarkMethodStreamed(
      0, new grpc::internal::BidiStreamingHandler<LinkService, grpc::ByteBuffer, grpc::ByteBuffer>(
             [](LinkService* service, grpc::ServerContext* context, RawLinkStream* stream) {
               return service->LinkRaw(context, stream);
             },
             this));
}

LinkService::~LinkService() {
  Shutdown();
  std::map<DialledIn, std::shared_ptr<LinkEnd>> dialled_in;
  {
    absl::MutexLock lock(&mu_);
    dialled_in.swap(dialled_in_);
  }
  for (auto& [key, end] : dialled_in) end->WaitServed(absl::InfiniteDuration());
}

void LinkService::SetWorkerId(const std::string& id) {
  absl::MutexLock lock(&mu_);
  worker_id_ = id;
}

void LinkService::Activate(std::shared_ptr<const LinkValidator> validator,
                           std::shared_ptr<Inbox> inbox,
                           std::set<std::string> dialling_downstream) {
  absl::MutexLock lock(&mu_);
  validator_ = std::move(validator);
  inbox_ = std::move(inbox);
  dialling_downstream_ = std::move(dialling_downstream);
}

void LinkService::Deactivate() {
  {
    absl::MutexLock lock(&mu_);
    validator_ = nullptr;
    inbox_ = nullptr;
    dialling_downstream_.clear();
    for (auto& [key, end] : dialled_in_) end->EndOnPurpose();
    dialled_in_.clear();
  }
  upstream_links_.EndAll();
}

void LinkService::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  Deactivate();
}

absl::Status LinkService::ReadHello(LinkTransport* transport, const std::string& pending_key,
                                    const std::string& peer_name, FrameParts* hello) {
  {
    absl::MutexLock lock(&mu_);
    if (pending_total_ >= options_.max_pending ||
        pending_hellos_[pending_key] >= options_.max_pending_per_peer) {
      if (pending_hellos_[pending_key] == 0) pending_hellos_.erase(pending_key);
      return Refusal(absl::StatusCode::kResourceExhausted, peer_name,
                     absl::StrCat("too many link streams waiting for their HELLO (",
                                  options_.max_pending_per_peer, " per peer, ",
                                  options_.max_pending, " in all)"));
    }
    ++pending_hellos_[pending_key];
    ++pending_total_;
  }
  bool read, stalled;
  IncomingFrame frame;
  {
    StallWatchdog::Guard guard = StallWatchdog::Shared().Watch(
        options_.hello_timeout, [transport] { transport->Cancel(); });
    read = transport->Read(&frame);
    stalled = guard.stalled();
  }
  {
    absl::MutexLock lock(&mu_);
    --pending_total_;
    if (--pending_hellos_[pending_key] == 0) pending_hellos_.erase(pending_key);
  }
  if (stalled) {
    return Refusal(absl::StatusCode::kDeadlineExceeded, peer_name,
                   absl::StrCat("no HELLO within ", absl::FormatDuration(options_.hello_timeout)));
  }
  if (!read) return absl::CancelledError("link ended before its HELLO");
  absl::StatusOr<FrameParts> parts = ParseFrame(frame.pieces);
  if (!parts.ok()) {
    return Refusal(absl::StatusCode::kInvalidArgument, peer_name, parts.status().message());
  }
  hello->header = std::move(parts->header);
  hello->data_bytes = parts->data_bytes;  // (its views die with `frame`)
  hello->last = parts->last;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<LinkEnd>> LinkService::Answer(
    std::unique_ptr<LinkTransport> transport, const std::string& identity,
    const std::string& peer_name) {
  const bool authenticated = !options_.transport.insecure;
  if (authenticated && identity.empty()) {
    return Refusal(absl::StatusCode::kUnauthenticated, peer_name,
                   "a link needs a worker certificate of this cluster");
  }
  if (absl::Status allowed = CheckNotRevoked(identity); !allowed.ok()) {
    return Refusal(allowed.code(), peer_name, allowed.message());
  }
  FrameParts hello;
  if (absl::Status read = ReadHello(transport.get(), authenticated ? identity : PeerHost(peer_name),
                                    peer_name, &hello);
      !read.ok()) {
    return read;
  }
  std::shared_ptr<LinkEnd> end;
  std::shared_ptr<const LinkValidator> validator;
  PeerSide side;
  LinkMessage ack;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return Refusal(absl::StatusCode::kUnavailable, peer_name, "shutting down");
    if (validator_ == nullptr) {
      return Refusal(absl::StatusCode::kFailedPrecondition, peer_name,
                     "this worker has no stage in a plan yet");
    }
    if (!hello.header.has_value()) {
      return Refusal(absl::StatusCode::kInvalidArgument, peer_name,
                     "first frame of a link has no header");
    }
    const v1::LinkHeader& h = *hello.header;
    if (authenticated && h.from_worker() != identity) {
      return Refusal(absl::StatusCode::kPermissionDenied, peer_name,
                     absl::StrCat("HELLO as '", h.from_worker().substr(0, 128),
                                  "' from a peer whose certificate names '", identity, "'"));
    }
    const bool hello = h.kind() == v1::MESSAGE_KIND_HELLO;
    side = hello && h.from_stage() == validator_->stage() + 1 ? PeerSide::kDownstream
           : hello && h.from_stage() == validator_->stage()   ? PeerSide::kReplica
                                                              : PeerSide::kUpstream;
    absl::Status valid =
        side == PeerSide::kUpstream   ? validator_->CheckHello(h)
        : side == PeerSide::kReplica ? validator_->CheckHelloFromReplica(h, worker_id_)
                                     : validator_->CheckHelloFromDownstream(
                                           h, dialling_downstream_, worker_id_);
    if (!valid.ok()) {
      // INVALID_ARGUMENT, or FAILED_PRECONDITION (the dialler retries) for a
      // plan epoch this worker has not started yet.
      return Refusal(valid.code(), peer_name, valid.message());
    }
    validator = validator_;
    // An outer-sync link carries its own epoch (the later of its two
    // pipelines').
    std::shared_ptr<const LinkValidator> link_validator =
        side == PeerSide::kReplica ? validator_->ForReplicaLink(h.from_worker()) : validator_;
    LinkEnd::Peer peer{h.from_worker(), peer_name, side};
    end = std::make_shared<LinkEnd>(std::move(transport), std::move(peer), /*dialled=*/false,
                                    link_validator, inbox_, options_.write_stall_timeout);
    ack.header = MakeHello(link_validator->epoch(), link_validator->stage());
  }
  // A worker that has a live link here gets no second one (and no answer).
  if (side == PeerSide::kUpstream) {
    if (absl::Status free = upstream_links_.AwaitNoLink(end->peer().id,
                                                        options_.duplicate_link_wait);
        !free.ok()) {
      end->EndOnPurpose();
      if (options_.on_key_in_use_twice) {
        options_.on_key_in_use_twice(end->peer().id, absl::StrCat("a second link from ",
                                                                  peer_name, ": ",
                                                                  free.message()));
      }
      return Refusal(free.code(), peer_name, free.message());
    }
  }
  // The answer goes first: nothing may be sent on the link before it.
  if (absl::Status sent = end->Send(std::move(ack)); !sent.ok()) {
    end->EndOnPurpose();
    return absl::CancelledError("link ended before its HELLO was answered");
  }
  LinkEnd* raw = end.get();
  if (side == PeerSide::kUpstream) {
    end->SetHooks(
        [this, worker = end->peer().id](const v1::LinkHeader& forward) {
          upstream_links_.NoteOrigin(forward, worker);
        },
        [this, raw] { upstream_links_.Unregister(raw); });
    if (absl::Status registered = upstream_links_.Register(end, options_.duplicate_link_wait);
        !registered.ok()) {
      end->EndOnPurpose();
      if (absl::IsAlreadyExists(registered) && options_.on_key_in_use_twice) {
        options_.on_key_in_use_twice(end->peer().id,
                                     absl::StrCat("a second link from ", peer_name, ": ",
                                                  registered.message()));
      }
      return Refusal(registered.code(), peer_name, registered.message());
    }
  } else {
    end->SetHooks(nullptr, [this, raw] {
      absl::MutexLock lock(&mu_);
      if (auto it = dialled_in_.find({raw->peer().side, raw->peer().id});
          it != dialled_in_.end() && it->second.get() == raw) {
        dialled_in_.erase(it);
      }
    });
  }
  bool stale;
  bool duplicate = false;
  {
    // Only for the plan it was checked against: a re-plan meanwhile ends it.
    absl::MutexLock lock(&mu_);
    stale = validator_ != validator;
    if (!stale && side != PeerSide::kUpstream) {
      // As for upstream links: a live link of the same worker stays.
      const DialledIn key{side, end->peer().id};
      auto old_gone = [this, &key, &validator]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return dialled_in_.count(key) == 0 || validator_ != validator || shutdown_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&old_gone), options_.duplicate_link_wait);
      stale = validator_ != validator || shutdown_;
      duplicate = !stale && dialled_in_.count(key) > 0;
      if (!stale && !duplicate) dialled_in_[key] = end;
    }
  }
  if (duplicate) {
    end->EndOnPurpose();
    const std::string why = absl::StrCat("key in use twice: worker '",
                                         end->peer().id.substr(0, 128),
                                         "' already has a live ", PeerSideName(side),
                                         " link here; the second one is refused");
    if (options_.on_key_in_use_twice) {
      options_.on_key_in_use_twice(end->peer().id,
                                   absl::StrCat("a second link from ", peer_name, ": ", why));
    }
    return Refusal(absl::StatusCode::kAlreadyExists, peer_name, why);
  }
  if (stale) {
    end->EndOnPurpose();
    if (side == PeerSide::kUpstream) upstream_links_.Unregister(raw);
    return absl::CancelledError("the plan changed while the link was being answered");
  }
  GT_LOG(Info) << "accepted " << PeerSideName(side) << " link from " << peer_name << " ('"
               << end->peer().id << "')";
  return end;
}

absl::StatusOr<std::shared_ptr<LinkEnd>> LinkService::AwaitDialIn(
    PeerSide side, const std::string& id, absl::Duration timeout, const std::atomic<bool>* stop) {
  const absl::Time deadline = absl::Now() + timeout;
  const DialledIn key{side, id};
  absl::MutexLock lock(&mu_);
  // Not one ended on purpose whose reader has not returned yet (a re-plan
  // replaced it; its successor is awaited).
  auto arrived = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = dialled_in_.find(key);
    if (shutdown_ || it == dialled_in_.end()) return shutdown_;
    const LinkEnd::State state = it->second->state();
    return state == LinkEnd::State::kAnswered || state == LinkEnd::State::kReading;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&arrived), absl::Milliseconds(200))) {
    if (stop != nullptr && *stop) return absl::CancelledError("stopped while waiting for a link");
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat(
          "the ", PeerSideName(side), " worker '", id, "' did not dial in within ",
          absl::FormatDuration(timeout),
          " (the plan has it dial this worker because it is not reachable itself): check that "
          "it can reach this worker's advertised address"));
    }
  }
  if (shutdown_) return absl::CancelledError("shutting down");
  return dialled_in_[key];
}

grpc::Status LinkService::LinkRaw(grpc::ServerContext* context, RawLinkStream* stream) {
  const std::string peer = context->peer();
  const std::string identity = options_.transport.insecure ? "" : PeerIdentity(*context);
  absl::StatusOr<std::shared_ptr<LinkEnd>> end =
      Answer(MakeGrpcServerTransport(context, stream, "dialled by " + peer), identity, peer);
  if (!end.ok()) return ToGrpcStatus(end.status());
  absl::Status served = (*end)->Serve();
  if (served.code() == absl::StatusCode::kInvalidArgument) return ToGrpcStatus(served);
  return served.ok() ? grpc::Status::OK : grpc::Status(grpc::StatusCode::CANCELLED, "link ended");
}

void LinkService::SetRevoked(std::set<std::string> revoked) {
  absl::MutexLock lock(&mu_);
  revoked_ = std::move(revoked);
}

absl::Status LinkService::CheckNotRevoked(const std::string& identity) const {
  if (options_.transport.insecure || identity.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (revoked_.count(identity) > 0) {
    return absl::UnauthenticatedError(absl::StrCat("worker ", identity.substr(0, 128),
                                                   " was revoked by the coordinator"));
  }
  return absl::OkStatus();
}

grpc::Status LinkService::Probe(grpc::ServerContext* context, const v1::ProbeRequest* request,
                                v1::ProbeResponse* response) {
  if (absl::Status allowed = CheckNotRevoked(PeerIdentity(*context)); !allowed.ok()) {
    return ToGrpcStatus(allowed);
  }
  absl::MutexLock lock(&mu_);
  response->set_worker_id(worker_id_);
  return grpc::Status::OK;
}

grpc::Status LinkService::Measure(grpc::ServerContext* context,
                                  const v1::MeasureRequest* request,
                                  v1::MeasureResponse* response) {
  if (absl::Status allowed = CheckNotRevoked(PeerIdentity(*context)); !allowed.ok()) {
    return ToGrpcStatus(allowed);
  }
  if (request->payload().size() > kMaxMeasurePayloadBytes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("measure payload of ", request->payload().size(),
                                     " bytes: at most ", kMaxMeasurePayloadBytes));
  }
  // A member's access measurement fetches bytes too (MeasureAccess): no
  // more than a request may carry, for a caller that passed the same check
  // (with TLS: a member), and within a budget for all callers together, so
  // small requests cannot make this worker send without bound (without TLS
  // anyone passes the check).
  if (request->reply_bytes() > kMaxMeasurePayloadBytes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("measure reply of ", request->reply_bytes(),
                                     " bytes: at most ", kMaxMeasurePayloadBytes));
  }
  if (request->reply_bytes() > 0) {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - reply_window_start_ >= kMeasureReplyWindow) {
      reply_window_start_ = now;
      reply_bytes_in_window_ = 0;
    }
    if (reply_bytes_in_window_ + request->reply_bytes() > kMeasureReplyBudgetBytes) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("measure replies over their budget (",
                                       kMeasureReplyBudgetBytes >> 20, " MiB per ",
                                       absl::FormatDuration(kMeasureReplyWindow), ")"));
    }
    reply_bytes_in_window_ += request->reply_bytes();
  }
  response->set_received(request->payload().size());
  response->mutable_payload()->assign(request->reply_bytes(), '\x5a');
  return grpc::Status::OK;
}

}  // namespace geotrain
