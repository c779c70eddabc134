#include "worker/link_stream.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/grpc_status.h"
#include "common/link_rate_meter.h"
#include "common/logging.h"
#include "common/stage_probe.h"
#include "common/status_macros.h"
#include "common/rpc_options.h"
#include "common/tcp_socket.h"
#include "common/tls_session.h"
#include "worker/stall_watchdog.h"

namespace geotrain {
namespace {

// A reader that spent this long handing a message to the inbox was held up
// by it; what it reads next arrived meanwhile (see LinkRateMeter).
constexpr absl::Duration kStall = absl::Milliseconds(1);
constexpr absl::Duration kTlsHandshakeTimeout = absl::Seconds(10);

absl::Status Refusal(absl::StatusCode code, const std::string& peer, absl::string_view reason) {
  GT_LOG(Warning) << "refused link from " << peer << ": " << reason;
  return absl::Status(code, reason);
}

// Frames go back to back; a message of kMinTimedMessageBytes or more is
// split in at least kTimedMessageFrames, so the receiver can time its
// dispersion. A frame
// that cannot be written within `stall_limit` (the peer stopped reading)
// cancels the transport.
// The frames are ranges of the payload, written without copying it.
bool WriteMessage(LinkTransport* transport, std::shared_ptr<const LinkMessage> message,
                  absl::Duration stall_limit) {
  const size_t size = message->payload.size();
  const size_t frame_bytes =
      size >= kMinTimedMessageBytes
          ? std::min(kFrameBytes, (size + kTimedMessageFrames - 1) / kTimedMessageFrames)
          : kFrameBytes;
  for (const FrameRange& range : FrameRanges(size, frame_bytes)) {
    StallWatchdog::Guard guard =
        StallWatchdog::Shared().Watch(stall_limit, [transport] { transport->Cancel(); });
    if (!transport->Write(OutgoingFrame{message, range})) {
      if (guard.stalled()) {
        GT_LOG(Warning) << "cut a link whose peer read nothing for "
                        << absl::FormatDuration(stall_limit);
      }
      return false;
    }
  }
  return true;
}

// What to check when a dial fails, from the words of the error.
std::string DialAdvice(const std::string& address, absl::string_view error) {
  if (absl::StrContains(error, "andshake") || absl::StrContains(error, "CERTIFICATE") ||
      absl::StrContains(error, "ertificate")) {
    return absl::StrCat("the TLS handshake with ", address,
                        " failed: the peer's certificate must come from this cluster's CA, name "
                        "the worker the plan put there, and be unexpired");
  }
  if (absl::StrContains(error, "refused")) {
    return absl::StrCat("nothing accepts TCP on ", address,
                        ": check the peer's --listen/--advertise port and its firewall");
  }
  return absl::StrCat("no answer from ", address,
                      ": check that it is the peer's reachable address (its --advertise) and "
                      "that no firewall or NAT drops connections to that port");
}

}  // namespace

const char* PeerSideName(PeerSide side) {
  return side == PeerSide::kUpstream ? "upstream" : "downstream";
}

v1::LinkHeader MakeHello(uint64_t epoch, int from_stage, const std::string& from_worker,
                         const std::string& to_worker) {
  v1::LinkHeader hello;
  hello.set_kind(v1::MESSAGE_KIND_HELLO);
  hello.set_epoch(epoch);
  hello.set_from_stage(from_stage);
  hello.set_from_worker(from_worker);
  hello.set_to_worker(to_worker);
  return hello;
}

// ---- LinkEnd ----

LinkEnd::LinkEnd(std::unique_ptr<LinkTransport> transport, Peer peer, bool dialled,
                 std::shared_ptr<const LinkValidator> validator, std::shared_ptr<Inbox> inbox,
                 absl::Duration write_stall_timeout)
    : transport_(std::move(transport)),
      peer_(std::move(peer)),
      dialled_(dialled),
      description_(transport_->description()),
      validator_(std::move(validator)),
      inbox_(std::move(inbox)),
      write_stall_timeout_(write_stall_timeout) {}

LinkEnd::~LinkEnd() {
  if (!served_.HasBeenNotified()) EndOnPurpose();
}

void LinkEnd::SetHooks(std::function<void(const v1::LinkHeader&)> on_forward,
                       std::function<void()> on_end) {
  on_forward_ = std::move(on_forward);
  on_end_ = std::move(on_end);
}

void LinkEnd::CancelTransport() {
  absl::MutexLock lock(&cancel_mu_);
  if (!retired_) transport_->Cancel();
}

void LinkEnd::EndOnPurpose() {
  on_purpose_ = true;
  CancelTransport();
}

absl::Status LinkEnd::Send(LinkMessage message) {
  auto shared = std::make_shared<const LinkMessage>(std::move(message));
  absl::MutexLock lock(&write_mu_);
  if (retired_) {
    return absl::UnavailableError(absl::StrCat(PeerSideName(peer_.side), " link to '", peer_.id,
                                               "' (", description_, ") is closed"));
  }
  if (!WriteMessage(transport_.get(), std::move(shared), write_stall_timeout_)) {
    return absl::UnavailableError(absl::StrCat(PeerSideName(peer_.side), " link to '", peer_.id,
                                               "' (", description_, ") broke while sending"));
  }
  return absl::OkStatus();
}

absl::Status LinkEnd::Serve() {
  serving_ = true;
  const bool from_upstream = peer_.side == PeerSide::kUpstream;
  const LinkValidator* validator = validator_.get();
  FrameAssembler assembler(kMaxMessageBytes, [validator, from_upstream](const v1::LinkHeader& h) {
    return from_upstream ? validator->CheckHeaderFromUpstream(h)
                         : validator->CheckHeaderFromDownstream(h);
  });
  IncomingFrame frame;
  absl::Status failure;
  bool after_stall = false, stopping = false;
  std::vector<FrameArrival> arrivals;  // of the message being assembled
  int64_t delivered = 0;
  while (transport_->Read(&frame)) {
    absl::StatusOr<FrameParts> parts = ParseFrame(frame.pieces);
    if (!parts.ok()) {
      failure = parts.status();
      break;
    }
    if (parts->header.has_value()) arrivals.clear();
    // Bounded whatever a peer sends (empty frames, say): past the limit the
    // last entry stands for every later frame, so the last arrival and the
    // bytes after each earlier one stay exact.
    if (arrivals.size() < kMaxTimedFrameArrivals) {
      arrivals.push_back({absl::Now(), parts->data_bytes});
    } else {
      arrivals.back().at = absl::Now();
      arrivals.back().bytes += parts->data_bytes;
    }
    absl::StatusOr<std::optional<LinkMessage>> added = assembler.Add(*std::move(parts));
    if (!added.ok()) {
      failure = added.status();
      break;
    }
    if (!added->has_value()) continue;
    LinkMessage& message = **added;
    const TrainTiming train = TimeTrain(arrivals);
    failure = from_upstream ? validator->CheckFromUpstream(message)
                            : validator->CheckFromDownstream(message);
    if (!failure.ok()) break;
    if (from_upstream && on_forward_ &&
        (message.header.kind() == v1::MESSAGE_KIND_ACTIVATION ||
         message.header.kind() == v1::MESSAGE_KIND_EVAL)) {
      on_forward_(message.header);
    }
    const absl::Time pushing = absl::Now();
    InboundMessage in{from_upstream, std::move(message), absl::OkStatus(),
                      train.trailing_bytes, train.dispersion, after_stall};
    in.peer = peer_.id;
    if (!inbox_->Push(std::move(in))) {
      stopping = true;  // the worker is ending this attempt
      break;
    }
    after_stall = absl::Now() - pushing > kStall;
    ++delivered;
  }
  if ((!failure.ok() || stopping) && !transport_->ends_when_served()) CancelTransport();
  absl::Status ended;
  {
    // No write is in flight once this lock is held (one blocked on a peer
    // that stopped reading fails within the stall limit); none starts
    // afterwards. How the peer ended the link is read before anything
    // here cancels it.
    absl::MutexLock write_lock(&write_mu_);
    ended = failure.ok() ? transport_->Finish() : failure;
    absl::MutexLock cancel_lock(&cancel_mu_);
    retired_ = true;
  }
  // A link this worker opened is broken unless it closed it. One a peer
  // opened is broken when it was cut (not cleanly closed) after carrying
  // traffic, or at once for a downstream peer (this worker sends to it); a
  // refused message only ends that stream (the peer may open another), so
  // a hostile stream cannot stop the pipeline.
  const bool broken =
      !on_purpose_ && !stopping &&
      (dialled_ ? !failure.ok() || !closing_
                : failure.ok() && !ended.ok() && (delivered > 0 || !from_upstream));
  if (!failure.ok()) {
    GT_LOG(Error) << "refused a message on the " << PeerSideName(peer_.side) << " link to '"
                  << peer_.id << "' (" << description_ << "): " << failure.message();
  }
  if (broken) {
    const std::string why = absl::StrCat(
        PeerSideName(peer_.side), " link to '", peer_.id, "' (", description_, ") ",
        failure.ok() ? (ended.ok() ? "ended unexpectedly" : "broke: " + std::string(ended.message()))
                     : "refused a message: " + std::string(failure.message()));
    GT_LOG(Error) << why;
    InboundMessage message{from_upstream, LinkMessage(), absl::UnavailableError(why)};
    message.peer = peer_.id;
    inbox_->TryPush(std::move(message));
  }
  const std::function<void()> on_end = on_end_;
  if (on_end) on_end();
  served_.Notify();
  return ended;
}

void LinkEnd::StartReader() {
  serving_ = true;
  std::thread([self = shared_from_this()] { (void)self->Serve(); }).detach();
}

absl::Status LinkEnd::Close(absl::Duration timeout) {
  closing_ = true;
  {
    absl::MutexLock lock(&write_mu_);
    LinkTransport* transport = transport_.get();
    StallWatchdog::Guard guard = StallWatchdog::Shared().Watch(
        write_stall_timeout_, [transport] { transport->Cancel(); });
    if (!retired_) transport_->CloseWrites();
  }
  if (!served_.WaitForNotificationWithTimeout(timeout)) {
    EndOnPurpose();
    served_.WaitForNotification();
    return absl::DeadlineExceededError(absl::StrCat(
        "the peer of the ", PeerSideName(peer_.side), " link to '", peer_.id,
        "' did not close it within ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

bool LinkEnd::WaitServed(absl::Duration timeout) const {
  if (!serving_) return true;
  return served_.WaitForNotificationWithTimeout(timeout);
}

// ---- UpstreamLinks ----

UpstreamLinks::~UpstreamLinks() {
  std::map<std::string, std::shared_ptr<LinkEnd>> links;
  {
    absl::MutexLock lock(&mu_);
    links.swap(links_);
  }
  for (auto& [worker, end] : links) end->EndOnPurpose();
  for (auto& [worker, end] : links) end->WaitServed(absl::InfiniteDuration());
}

absl::Status UpstreamLinks::AwaitNoLink(const std::string& worker, absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  auto gone = [this, &worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return links_.count(worker) == 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&gone), wait)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "key in use twice: worker '", worker.substr(0, 128),
        "' already has a live upstream link here (", links_[worker]->description(),
        "); the second one is refused"));
  }
  return absl::OkStatus();
}

absl::Status UpstreamLinks::Register(std::shared_ptr<LinkEnd> end, absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  const std::string worker = end->peer().id;
  if (auto old = links_.find(worker); old != links_.end()) {
    std::shared_ptr<LinkEnd> previous = old->second;
    auto old_gone = [this, &previous, &worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = links_.find(worker);
      return it == links_.end() || it->second != previous;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&old_gone), wait)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "key in use twice: worker '", worker.substr(0, 128),
          "' already has a live upstream link here (", previous->description(),
          "); the second one is refused"));
    }
  }
  links_[worker] = std::move(end);
  return absl::OkStatus();
}

void UpstreamLinks::Unregister(const LinkEnd* end) {
  std::shared_ptr<LinkEnd> released;  // dropped after the lock
  absl::MutexLock lock(&mu_);
  if (auto it = links_.find(end->peer().id); it != links_.end() && it->second.get() == end) {
    released = std::move(it->second);
    links_.erase(it);
  }
}

void UpstreamLinks::NoteOrigin(const v1::LinkHeader& forward, const std::string& worker) {
  absl::MutexLock lock(&mu_);
  if (forward.kind() != v1::MESSAGE_KIND_EVAL) {
    origin_[forward.microbatch()] = worker;
    return;
  }
  eval_origin_[forward.step()] = worker;
  if (eval_origin_.size() > kMaxEvalOrigins) eval_origin_.erase(eval_origin_.begin());
}

void UpstreamLinks::EndAll() {
  absl::MutexLock lock(&mu_);
  for (auto& [worker, end] : links_) end->EndOnPurpose();
  origin_.clear();
  eval_origin_.clear();
}

absl::Status UpstreamLinks::Send(LinkMessage message) {
  std::shared_ptr<LinkEnd> end;
  {
    absl::MutexLock lock(&mu_);
    std::string worker;
    if (message.header.kind() == v1::MESSAGE_KIND_EVAL_ACK) {
      auto origin = eval_origin_.find(message.header.step());
      if (origin == eval_origin_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "no upstream link delivered the evaluation of step ", message.header.step()));
      }
      worker = origin->second;
    } else {
      auto origin = origin_.find(message.header.microbatch());
      if (origin == origin_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "no upstream link delivered microbatch ", message.header.microbatch()));
      }
      worker = origin->second;
      origin_.erase(origin);
    }
    auto ready = [this, &worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return links_.count(worker) > 0;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), connect_wait_);
    auto it = links_.find(worker);
    if (it == links_.end()) {
      failed_peer_ = worker;
      return absl::UnavailableError(
          absl::StrCat("no upstream link to '", worker, "' to send to"));
    }
    end = it->second;
  }
  absl::Status sent = end->Send(std::move(message));
  if (!sent.ok()) {
    absl::MutexLock lock(&mu_);
    failed_peer_ = end->peer().id;
  }
  return sent;
}

std::string UpstreamLinks::failed_peer() const {
  absl::MutexLock lock(&mu_);
  return failed_peer_;
}

// ---- LinkService ----

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
  std::map<std::string, std::shared_ptr<LinkEnd>> downstream;
  {
    absl::MutexLock lock(&mu_);
    downstream.swap(downstream_);
  }
  for (auto& [worker, end] : downstream) end->WaitServed(absl::InfiniteDuration());
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
    for (auto& [worker, end] : downstream_) end->EndOnPurpose();
    downstream_.clear();
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
    side = h.from_stage() == validator_->stage() + 1 && h.kind() == v1::MESSAGE_KIND_HELLO
               ? PeerSide::kDownstream
               : PeerSide::kUpstream;
    absl::Status valid = side == PeerSide::kUpstream
                             ? validator_->CheckHello(h)
                             : validator_->CheckHelloFromDownstream(h, dialling_downstream_,
                                                                    worker_id_);
    if (!valid.ok()) {
      // INVALID_ARGUMENT, or FAILED_PRECONDITION (the dialler retries) for a
      // plan epoch this worker has not started yet.
      return Refusal(valid.code(), peer_name, valid.message());
    }
    validator = validator_;
    LinkEnd::Peer peer{h.from_worker(), peer_name, side};
    end = std::make_shared<LinkEnd>(std::move(transport), std::move(peer), /*dialled=*/false,
                                    validator_, inbox_, options_.write_stall_timeout);
    ack.header = MakeHello(validator_->epoch(), validator_->stage());
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
      if (auto it = downstream_.find(raw->peer().id);
          it != downstream_.end() && it->second.get() == raw) {
        downstream_.erase(it);
      }
    });
  }
  bool stale;
  bool duplicate = false;
  {
    // Only for the plan it was checked against: a re-plan meanwhile ends it.
    absl::MutexLock lock(&mu_);
    stale = validator_ != validator;
    if (!stale && side == PeerSide::kDownstream) {
      // As for upstream links: a live link of the same worker stays.
      const std::string id = end->peer().id;
      auto old_gone = [this, &id, &validator]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return downstream_.count(id) == 0 || validator_ != validator || shutdown_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&old_gone), options_.duplicate_link_wait);
      stale = validator_ != validator || shutdown_;
      duplicate = !stale && downstream_.count(id) > 0;
      if (!stale && !duplicate) downstream_[id] = end;
    }
  }
  if (duplicate) {
    end->EndOnPurpose();
    const std::string why = absl::StrCat("key in use twice: worker '",
                                         end->peer().id.substr(0, 128),
                                         "' already has a live downstream link here; the "
                                         "second one is refused");
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

absl::StatusOr<std::shared_ptr<LinkEnd>> LinkService::AwaitDownstream(
    const std::string& id, absl::Duration timeout, const std::atomic<bool>* stop) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  auto arrived = [this, &id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shutdown_ || downstream_.count(id) > 0;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&arrived), absl::Milliseconds(200))) {
    if (stop != nullptr && *stop) return absl::CancelledError("stopped while waiting for a link");
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat(
          "the downstream worker '", id, "' did not dial in within ",
          absl::FormatDuration(timeout),
          " (the plan has it dial this worker because it is not reachable itself): check that "
          "it can reach this worker's advertised address"));
    }
  }
  if (shutdown_) return absl::CancelledError("shutting down");
  return downstream_[id];
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
  response->set_received(request->payload().size());
  return grpc::Status::OK;
}

// ---- Opening links ----

namespace {

struct Opened {
  std::unique_ptr<LinkTransport> transport;
  std::string identity;  // the peer's certified id (relayed TLS); "" otherwise
};

// HELLO out, answer in, on a transport this end opened.
absl::Status ExchangeHello(LinkTransport* transport, const LinkMessage& hello,
                           const LinkOptions& options) {
  IncomingFrame ack;
  if (!WriteMessage(transport, std::make_shared<const LinkMessage>(hello),
                    options.write_stall_timeout)) {
    absl::Status end = transport->Finish();
    return end.ok() ? absl::UnavailableError("the link broke while sending its HELLO") : end;
  }
  bool read, stalled;
  {
    StallWatchdog::Guard guard = StallWatchdog::Shared().Watch(
        options.connect_timeout, [transport] { transport->Cancel(); });
    read = transport->Read(&ack);
    stalled = guard.stalled();
  }
  absl::StatusOr<FrameParts> answer =
      read ? ParseFrame(ack.pieces) : absl::StatusOr<FrameParts>(FrameParts());
  if (!read || stalled || !answer.ok() || !answer->header.has_value() ||
      answer->header->kind() != v1::MESSAGE_KIND_HELLO) {
    if (read) transport->Cancel();  // the stream is still open: Finish would wait for it
    absl::Status end = transport->Finish();
    return end.ok() ? absl::UnavailableError("the peer ended the link without answering its HELLO")
                    : end;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LinkTransport>> DialDirect(const DialTarget& target,
                                                          const std::string& address,
                                                          const LinkMessage& hello,
                                                          const LinkOptions& options,
                                                          const std::atomic<bool>* stop) {
  const std::string direction = PeerSideName(target.peer.side);
  // With TLS the peer's certificate must name the worker the plan put there.
  auto channel = MakeSecureChannel(address, options.transport, target.peer.id);
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  std::optional<absl::Time> unreachable_since;
  absl::Duration backoff = absl::Milliseconds(100);
  while (true) {
    const absl::Time attempt_start = absl::Now();
    // The stream lives as long as training; liveness is checked by keepalive
    // (rpc_options.cc) rather than a deadline.
    auto transport = MakeGrpcClientTransport(channel, std::make_unique<grpc::ClientContext>(),
                                             absl::StrCat("dialled to ", address));
    absl::Status exchanged = ExchangeHello(transport.get(), hello, options);
    if (exchanged.ok()) return transport;
    const absl::StatusCode code = exchanged.code();
    const bool retryable = code == absl::StatusCode::kUnavailable ||
                           code == absl::StatusCode::kFailedPrecondition ||
                           code == absl::StatusCode::kAlreadyExists ||
                           code == absl::StatusCode::kCancelled;
    if (!retryable) {
      return absl::Status(code, absl::StrCat("the ", direction, " link to '", target.peer.id,
                                             "' at ", address, " was refused: ",
                                             exchanged.message()));
    }
    if (code == absl::StatusCode::kUnavailable) {
      if (!unreachable_since) unreachable_since = attempt_start;
    } else {
      unreachable_since.reset();  // it answered: alive, not ready yet
    }
    if (absl::Now() + backoff > deadline ||
        (unreachable_since && absl::Now() - *unreachable_since > options.unreachable_timeout)) {
      return absl::UnavailableError(absl::StrCat(
          "cannot open the ", direction, " link to '", target.peer.id, "' at ", address,
          " (this worker dials): ", exchanged.message(), ". ",
          DialAdvice(address, exchanged.message())));
    }
    if (stop != nullptr && *stop) return absl::CancelledError("stopped while connecting");
    GT_LOG(Info) << "link to " << address << " not ready (" << exchanged.message()
                 << "); retrying in " << absl::FormatDuration(backoff);
    absl::SleepFor(backoff);
    // Capped low: after a re-plan the peer usually activates its stage
    // within a second or two, and each retry is one small RPC.
    backoff = std::min(backoff * 2, absl::Milliseconds(500));
  }
}

// Both ends dial the relay and present the link's rendezvous; the relay
// answers "OK" once the other end is there, then splices.
absl::StatusOr<Opened> DialRelay(const DialTarget& target, const LinkOptions& options,
                                 const std::atomic<bool>* stop) {
  const v1::PlannedLink& planned = *target.planned;
  const std::string& relay = planned.relay_address();
  const bool upstream_end = target.peer.side == PeerSide::kDownstream;
  const std::string what = absl::StrCat("the relay '", planned.relay_worker(), "' at ", relay,
                                        " for the ", PeerSideName(target.peer.side),
                                        " link to '", target.peer.id, "'");
  const std::string greeting =
      absl::StrCat(kRelayGreeting, " ", planned.rendezvous(), " ", upstream_end ? "up" : "down",
                   " ", upstream_end ? planned.upstream_proof() : planned.downstream_proof(), "\n");
  // The other end may come late (it restores a checkpoint, or waits for its
  // own downstream links first): a relay that gives up on the pair is asked
  // again until connect_timeout.
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  absl::Time unreachable_until = absl::Now() + options.unreachable_timeout;
  absl::StatusOr<TcpSocket> socket = absl::UnavailableError("not tried");
  std::string last_answer;
  while (true) {
    if (stop != nullptr && *stop) return absl::CancelledError("stopped while connecting");
    if (absl::Now() > deadline) {
      return absl::UnavailableError(
          absl::StrCat(what, " did not pair the link within ",
                       absl::FormatDuration(options.connect_timeout), ": ", last_answer));
    }
    socket = TcpSocket::Connect(relay, absl::Seconds(5));
    if (!socket.ok()) {
      if (absl::Now() > unreachable_until) {
        return absl::UnavailableError(
            absl::StrCat("cannot reach ", what, ": ", socket.status().message()));
      }
      absl::SleepFor(absl::Milliseconds(500));
      continue;
    }
    unreachable_until = absl::Now() + options.unreachable_timeout;
    socket->SetKeepalive(absl::Milliseconds(kKeepaliveTimeMs), absl::Seconds(2));
    socket->SetTimeouts(absl::Seconds(1), options.write_stall_timeout);
    if (!socket->WriteAll(greeting.data(), greeting.size())) {
      last_answer = "it closed the connection";
      absl::SleepFor(absl::Milliseconds(500));
      continue;
    }
    // The relay answers once the other end is there; wait in 1 s slices so
    // that a re-plan (`stop`) is noticed.
    absl::StatusOr<std::string> answer = absl::DeadlineExceededError("");
    while (true) {
      answer = socket->ReadLine(512);
      if (answer.ok() || answer.status().code() != absl::StatusCode::kDeadlineExceeded) break;
      if ((stop != nullptr && *stop) || absl::Now() > deadline) break;
    }
    if (answer.ok() && *answer == "OK") break;
    last_answer = answer.ok() ? *answer : std::string(answer.status().message());
    absl::SleepFor(absl::Milliseconds(500));
  }
  socket->SetTimeouts(absl::InfiniteDuration(), absl::InfiniteDuration());
  const std::string description =
      absl::StrCat("via relay ", planned.relay_worker(), " at ", relay);
  Opened opened;
  if (options.transport.insecure) {
    opened.transport = MakeRelayedTransport(*std::move(socket), description);
    return opened;
  }
  absl::StatusOr<std::unique_ptr<TlsSession>> tls = TlsSession::Establish(
      *std::move(socket), upstream_end ? TlsSession::Role::kClient : TlsSession::Role::kServer,
      options.transport, target.peer.id, kTlsHandshakeTimeout);
  if (!tls.ok()) {
    return absl::Status(tls.status().code(),
                        absl::StrCat("end-to-end TLS with '", target.peer.id, "' ", description,
                                     ": ", tls.status().message()));
  }
  opened.identity = (*tls)->peer_identity();
  opened.transport = MakeRelayedTransport(*std::move(tls), description);
  return opened;
}

}  // namespace

absl::StatusOr<std::shared_ptr<LinkEnd>> OpenLink(
    const DialTarget& target, std::shared_ptr<const LinkValidator> validator,
    std::shared_ptr<Inbox> inbox, const LinkOptions& options, LinkService* service,
    const std::atomic<bool>* stop) {
  LinkMessage hello;
  hello.header = MakeHello(validator->epoch(), validator->stage(), target.self_id, target.peer.id);
  const bool relayed =
      target.planned != nullptr && target.planned->dialer() == v1::LINK_DIALER_RELAY;
  std::shared_ptr<LinkEnd> end;
  if (relayed) {
    ASSIGN_OR_RETURN(Opened opened, DialRelay(target, options, stop));
    if (target.peer.side == PeerSide::kUpstream) {
      // The upstream end speaks first; answer it as if it had dialled.
      ASSIGN_OR_RETURN(end, service->Answer(std::move(opened.transport), opened.identity,
                                            opened.identity.empty() ? target.peer.id
                                                                    : opened.identity));
      if (end->peer().id != target.peer.id) {
        end->EndOnPurpose();
        service->upstream_links()->Unregister(end.get());
        return absl::PermissionDeniedError(absl::StrCat(
            "the relayed link meant for '", target.peer.id, "' came from '", end->peer().id, "'"));
      }
      end->StartReader();
      return end;
    }
    if (absl::Status exchanged = ExchangeHello(opened.transport.get(), hello, options);
        !exchanged.ok()) {
      return absl::Status(exchanged.code(),
                          absl::StrCat("the downstream link to '", target.peer.id, "' ",
                                       opened.transport->description(), ": ",
                                       exchanged.message()));
    }
    end = std::make_shared<LinkEnd>(std::move(opened.transport), target.peer, /*dialled=*/true,
                                    validator, inbox, options.write_stall_timeout);
  } else {
    std::string address = target.peer.address;
    if (auto route = options.routes.find(address); route != options.routes.end()) {
      GT_LOG(Info) << "routing the link to " << address << " via " << route->second;
      address = route->second;
    }
    ASSIGN_OR_RETURN(std::unique_ptr<LinkTransport> transport,
                     DialDirect(target, address, hello, options, stop));
    end = std::make_shared<LinkEnd>(std::move(transport), target.peer, /*dialled=*/true,
                                    validator, inbox, options.write_stall_timeout);
  }
  if (target.peer.side == PeerSide::kUpstream) {
    UpstreamLinks* upstream = service->upstream_links();
    RETURN_IF_ERROR(upstream->Register(end, options.duplicate_link_wait));
    LinkEnd* raw = end.get();
    end->SetHooks(
        [upstream, worker = target.peer.id](const v1::LinkHeader& forward) {
          upstream->NoteOrigin(forward, worker);
        },
        [upstream, raw] { upstream->Unregister(raw); });
  }
  GT_LOG(Info) << "opened " << PeerSideName(target.peer.side) << " link to '" << target.peer.id
               << "' (" << end->description() << ")";
  end->StartReader();
  return end;
}

}  // namespace geotrain
