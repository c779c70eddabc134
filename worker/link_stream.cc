#include "worker/link_stream.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/link_rate_meter.h"
#include "common/logging.h"
#include "common/rpc_options.h"
#include "worker/stall_watchdog.h"

namespace geotrain {
namespace {

// A reader that spent this long handing a message to the inbox was held up
// by it; what it reads next arrived meanwhile (see LinkRateMeter).
constexpr absl::Duration kStall = absl::Milliseconds(1);

grpc::Status Refuse(grpc::StatusCode code, const std::string& peer,
                    absl::string_view reason) {
  GT_LOG(Warning) << "refused link from " << peer << ": " << reason;
  return grpc::Status(code, std::string(reason));
}

// Frames go back to back; a message of kMinTimedMessageBytes or more is
// split in at least two, so the receiver can time its dispersion. A frame
// that cannot be written within `stall_limit` (the peer stopped reading)
// cancels the stream through `context`.
template <typename Stream, typename Context>
bool WriteMessage(Stream* stream, const LinkMessage& message, Context* context,
                  absl::Duration stall_limit) {
  const size_t size = message.payload.size();
  const size_t frame_bytes =
      size >= kMinTimedMessageBytes ? std::min(kFrameBytes, (size + 1) / 2) : kFrameBytes;
  for (const v1::LinkFrame& frame : SplitIntoFrames(message, frame_bytes)) {
    StallWatchdog::Guard guard =
        StallWatchdog::Shared().Watch(stall_limit, [context] { context->TryCancel(); });
    if (!stream->Write(frame)) {
      if (guard.stalled()) {
        GT_LOG(Warning) << "cut a link whose peer read nothing for "
                        << absl::FormatDuration(stall_limit);
      }
      return false;
    }
  }
  return true;
}

}  // namespace

v1::LinkHeader MakeHello(uint64_t epoch, int from_stage, const std::string& from_worker) {
  v1::LinkHeader hello;
  hello.set_kind(v1::MESSAGE_KIND_HELLO);
  hello.set_epoch(epoch);
  hello.set_from_stage(from_stage);
  hello.set_from_worker(from_worker);
  return hello;
}

void UpstreamLinkServer::Activate(std::shared_ptr<const LinkValidator> validator,
                                  std::shared_ptr<Inbox> inbox) {
  absl::MutexLock lock(&mu_);
  validator_ = std::move(validator);
  inbox_ = std::move(inbox);
}

void UpstreamLinkServer::EndAllLocked() {
  for (auto& [worker, upstream] : upstreams_) {
    upstream->ended_on_purpose = true;
    upstream->context->TryCancel();
  }
  origin_.clear();
}

void UpstreamLinkServer::Deactivate() {
  absl::MutexLock lock(&mu_);
  validator_ = nullptr;
  inbox_ = nullptr;
  EndAllLocked();
}

void UpstreamLinkServer::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  EndAllLocked();
}

grpc::Status UpstreamLinkServer::ReadHello(
    grpc::ServerContext* context, grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream,
    const std::string& pending_key, v1::LinkFrame* hello) {
  const std::string peer = context->peer();
  {
    absl::MutexLock lock(&mu_);
    if (pending_total_ >= security_.max_pending ||
        pending_hellos_[pending_key] >= security_.max_pending_per_peer) {
      if (pending_hellos_[pending_key] == 0) pending_hellos_.erase(pending_key);
      return Refuse(grpc::StatusCode::RESOURCE_EXHAUSTED, peer,
                    absl::StrCat("too many link streams waiting for their HELLO (",
                                 security_.max_pending_per_peer, " per peer, ",
                                 security_.max_pending, " in all)"));
    }
    ++pending_hellos_[pending_key];
    ++pending_total_;
  }
  bool read, stalled;
  {
    StallWatchdog::Guard guard = StallWatchdog::Shared().Watch(
        security_.hello_timeout, [context] { context->TryCancel(); });
    read = stream->Read(hello);
    stalled = guard.stalled();
  }
  {
    absl::MutexLock lock(&mu_);
    --pending_total_;
    if (--pending_hellos_[pending_key] == 0) pending_hellos_.erase(pending_key);
  }
  if (stalled) {
    return Refuse(grpc::StatusCode::DEADLINE_EXCEEDED, peer,
                  absl::StrCat("no HELLO within ", absl::FormatDuration(security_.hello_timeout)));
  }
  return read ? grpc::Status::OK : grpc::Status::CANCELLED;
}

grpc::Status UpstreamLinkServer::Link(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream) {
  const std::string peer = context->peer();
  const bool authenticated = !security_.transport.insecure;
  const std::string identity = authenticated ? PeerIdentity(*context) : "";
  if (authenticated && identity.empty()) {
    return Refuse(grpc::StatusCode::UNAUTHENTICATED, peer,
                  "a link needs a worker certificate of this cluster");
  }
  v1::LinkFrame hello;
  if (grpc::Status read = ReadHello(context, stream, authenticated ? identity : PeerHost(peer),
                                    &hello);
      !read.ok()) {
    return read;
  }
  std::shared_ptr<const LinkValidator> validator;
  std::shared_ptr<Inbox> inbox;
  auto upstream = std::make_shared<Upstream>();
  upstream->stream = stream;
  upstream->context = context;
  {
    absl::MutexLock lock(&mu_);
    validator = validator_;
    inbox = inbox_;
    if (shutdown_) return Refuse(grpc::StatusCode::UNAVAILABLE, peer, "shutting down");
    if (validator == nullptr) {
      return Refuse(grpc::StatusCode::FAILED_PRECONDITION, peer,
                    "this worker has no stage in a plan yet");
    }
    if (!hello.has_header()) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT, peer,
                    "first frame of a link has no header");
    }
    if (authenticated && hello.header().from_worker() != identity) {
      return Refuse(grpc::StatusCode::PERMISSION_DENIED, peer,
                    absl::StrCat("HELLO as '", hello.header().from_worker().substr(0, 128),
                                 "' from a peer whose certificate names '", identity, "'"));
    }
    absl::Status valid = validator->CheckHello(hello.header());
    if (!valid.ok()) {
      // INVALID_ARGUMENT, or FAILED_PRECONDITION (the dialler retries) for a
      // plan epoch this worker has not started yet.
      return Refuse(static_cast<grpc::StatusCode>(valid.code()), peer, valid.message());
    }
    upstream->worker = hello.header().from_worker();
    if (auto old = upstreams_.find(upstream->worker); old != upstreams_.end()) {
      // The same upstream worker reconnected (its old stream may be dead
      // without this side having noticed yet): the newer stream wins.
      GT_LOG(Info) << "replacing the open upstream link of '" << upstream->worker
                   << "' with one from " << peer;
      std::shared_ptr<Upstream> previous = old->second;
      previous->ended_on_purpose = true;
      previous->context->TryCancel();
      auto old_gone = [this, &previous]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto it = upstreams_.find(previous->worker);
        return it == upstreams_.end() || it->second != previous;
      };
      if (!mu_.AwaitWithTimeout(absl::Condition(&old_gone), absl::Seconds(5))) {
        return Refuse(grpc::StatusCode::ALREADY_EXISTS, peer,
                      "an upstream link from this worker is already open");
      }
    }
    LinkMessage ack;
    ack.header = MakeHello(validator->epoch(), validator->stage());
    if (!WriteMessage(stream, ack, context, security_.write_stall_timeout)) {
      return grpc::Status::CANCELLED;
    }
    upstreams_[upstream->worker] = upstream;
  }
  GT_LOG(Info) << "accepted upstream link from " << peer
               << (upstream->worker.empty() ? "" : " ('" + upstream->worker + "')");
  int64_t delivered = 0;
  absl::Status served = ServeAccepted(upstream.get(), *validator, inbox.get(), &delivered);
  bool report_broken = false;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = upstreams_.find(upstream->worker);
        it != upstreams_.end() && it->second == upstream) {
      upstreams_.erase(it);
    }
    // A Send() still writing to this stream must finish before the stream
    // goes away; cancelling makes a blocked write fail at once.
    if (upstream->writers > 0) context->TryCancel();
    auto no_writers = [&upstream]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return upstream->writers == 0;
    };
    mu_.Await(absl::Condition(&no_writers));
    // A link that carried training traffic was cut (not a clean close, a
    // replacement, a re-plan or our own shutdown): the upstream worker
    // vanished. Tell the driver rather than let it wait forever.
    report_broken = delivered > 0 && served.code() == absl::StatusCode::kCancelled &&
                    !upstream->ended_on_purpose;
  }
  if (report_broken) {
    GT_LOG(Error) << "upstream link from " << peer << " broke";
    InboundMessage broken{true, LinkMessage(),
                          absl::UnavailableError(absl::StrCat("upstream link from ", peer,
                                                              " broke"))};
    broken.peer = upstream->worker;
    inbox->TryPush(std::move(broken));
  }
  if (served.code() == absl::StatusCode::kInvalidArgument) {
    return Refuse(grpc::StatusCode::INVALID_ARGUMENT, peer, served.message());
  }
  return ToGrpcStatus(served);
}

absl::Status UpstreamLinkServer::ServeAccepted(Upstream* upstream,
                                               const LinkValidator& validator, Inbox* inbox,
                                               int64_t* delivered) {
  FrameAssembler assembler(kMaxMessageBytes, [&validator](const v1::LinkHeader& header) {
    return validator.CheckHeaderFromUpstream(header);
  });
  v1::LinkFrame frame;
  bool after_stall = false;
  absl::Time first_at;
  uint64_t first_bytes = 0;
  while (upstream->stream->Read(&frame)) {
    if (frame.has_header()) {
      first_at = absl::Now();
      first_bytes = frame.data().size();
    }
    absl::StatusOr<std::optional<LinkMessage>> added = assembler.Add(std::move(frame));
    if (!added.ok()) return added.status();
    if (!added->has_value()) continue;
    LinkMessage& message = **added;
    const absl::Duration dispersion = absl::Now() - first_at;
    const uint64_t trailing = message.payload.size() - first_bytes;
    absl::Status valid = validator.CheckFromUpstream(message);
    if (!valid.ok()) return valid;
    if (message.header.kind() == v1::MESSAGE_KIND_ACTIVATION) {
      absl::MutexLock lock(&mu_);
      origin_[message.header.microbatch()] = upstream->worker;
    }
    const absl::Time pushing = absl::Now();
    InboundMessage in{true, std::move(message), absl::OkStatus(), trailing, dispersion,
                      after_stall};
    in.peer = upstream->worker;
    if (!inbox->Push(std::move(in))) return absl::CancelledError("worker is stopping");
    after_stall = absl::Now() - pushing > kStall;
    ++*delivered;
  }
  if (upstream->context->IsCancelled()) return absl::CancelledError("link cancelled");
  return absl::OkStatus();
}

absl::Status UpstreamLinkServer::Send(const LinkMessage& message) {
  std::shared_ptr<Upstream> upstream;
  {
    absl::MutexLock lock(&mu_);
    auto origin = origin_.find(message.header.microbatch());
    if (origin == origin_.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no upstream link delivered microbatch ", message.header.microbatch()));
    }
    const std::string worker = origin->second;
    origin_.erase(origin);
    auto ready = [this, &worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shutdown_ || upstreams_.count(worker) > 0;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), connect_wait_);
    auto it = upstreams_.find(worker);
    if (it == upstreams_.end()) {
      failed_peer_ = worker;
      return absl::UnavailableError(
          absl::StrCat("no upstream link to '", worker, "' to send to"));
    }
    upstream = it->second;
    ++upstream->writers;
  }
  bool written;
  {
    absl::MutexLock write_lock(&upstream->write_mu);
    written = WriteMessage(upstream->stream, message, upstream->context,
                           security_.write_stall_timeout);
  }
  absl::MutexLock lock(&mu_);
  --upstream->writers;
  if (!written) {
    failed_peer_ = upstream->worker;
    return absl::UnavailableError("upstream link broke while sending");
  }
  return absl::OkStatus();
}

std::string UpstreamLinkServer::failed_peer() const {
  absl::MutexLock lock(&mu_);
  return failed_peer_;
}

absl::StatusOr<std::unique_ptr<DownstreamLinkClient>> DownstreamLinkClient::Connect(
    const std::string& address, std::shared_ptr<const LinkValidator> validator,
    Inbox* inbox, absl::Duration timeout, const std::atomic<bool>* stop,
    const std::string& self_id, const std::string& peer_id,
    const LinkSecurityOptions& security) {
  std::unique_ptr<DownstreamLinkClient> client(new DownstreamLinkClient());
  client->address_ = address;
  client->peer_id_ = peer_id;
  client->validator_ = validator;
  client->inbox_ = inbox;
  client->write_stall_timeout_ = security.write_stall_timeout;
  // With TLS the peer's certificate must name the worker the plan put there.
  client->stub_ = v1::Stage::NewStub(MakeSecureChannel(address, security.transport, peer_id));
  const absl::Time deadline = absl::Now() + timeout;
  // A peer that answers "not ready" is waited for up to `timeout`; one that
  // cannot be reached at all is given up on as soon as an open link to it
  // would have been declared dead (keepalive time + timeout).
  const absl::Duration unreachable_limit =
      absl::Milliseconds(kKeepaliveTimeMs + kKeepaliveTimeoutMs);
  std::optional<absl::Time> unreachable_since;
  absl::Duration backoff = absl::Milliseconds(100);
  LinkMessage hello;
  hello.header = MakeHello(validator->epoch(), validator->stage(), self_id);
  while (true) {
    const absl::Time attempt_start = absl::Now();
    client->stream_.reset();  // a call goes before its context
    client->context_ = std::make_unique<grpc::ClientContext>();
    // The stream lives as long as training; liveness is checked by keepalive
    // (rpc_options.cc) rather than a deadline.
    client->stream_ = client->stub_->Link(client->context_.get());
    v1::LinkFrame ack;
    if (WriteMessage(client->stream_.get(), hello, client->context_.get(),
                     security.write_stall_timeout) &&
        client->stream_->Read(&ack) &&
        ack.has_header() && ack.header().kind() == v1::MESSAGE_KIND_HELLO) {
      break;
    }
    client->context_->TryCancel();
    const grpc::Status finished = client->stream_->Finish();
    client->stream_.reset();  // finished: the destructor must not finish it again
    const bool retryable = finished.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           finished.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
                           finished.error_code() == grpc::StatusCode::ALREADY_EXISTS ||
                           finished.error_code() == grpc::StatusCode::CANCELLED;
    if (!retryable) {
      return absl::Status(FromGrpcStatus(finished).code(),
                          absl::StrCat("link to ", address, " refused: ",
                                       finished.error_message()));
    }
    if (finished.error_code() == grpc::StatusCode::UNAVAILABLE) {
      if (!unreachable_since) unreachable_since = attempt_start;
    } else {
      unreachable_since.reset();  // it answered: alive, not ready yet
    }
    if (absl::Now() + backoff > deadline ||
        (unreachable_since && absl::Now() - *unreachable_since > unreachable_limit)) {
      return absl::UnavailableError(absl::StrCat("cannot open a link to ", address,
                                                 ": ", finished.error_message()));
    }
    if (stop != nullptr && *stop) return absl::CancelledError("stopped while connecting");
    GT_LOG(Info) << "link to " << address << " not ready (" << finished.error_message()
                 << "); retrying in " << absl::FormatDuration(backoff);
    absl::SleepFor(backoff);
    // Capped low: after a re-plan the peer usually activates its stage
    // within a second or two, and each retry is one small RPC.
    backoff = std::min(backoff * 2, absl::Milliseconds(500));
  }
  GT_LOG(Info) << "opened downstream link to " << address;
  DownstreamLinkClient* raw = client.get();
  client->reader_ = std::thread([raw] { raw->ReadLoop(); });
  return client;
}

void DownstreamLinkClient::ReadLoop() {
  FrameAssembler assembler(kMaxMessageBytes, [this](const v1::LinkHeader& header) {
    return validator_->CheckHeaderFromDownstream(header);
  });
  v1::LinkFrame frame;
  absl::Status failure;
  bool after_stall = false;
  absl::Time first_at;
  uint64_t first_bytes = 0;
  while (failure.ok() && stream_->Read(&frame)) {
    if (frame.has_header()) {
      first_at = absl::Now();
      first_bytes = frame.data().size();
    }
    absl::StatusOr<std::optional<LinkMessage>> added = assembler.Add(std::move(frame));
    if (!added.ok()) {
      failure = added.status();
      break;
    }
    if (!added->has_value()) continue;
    const absl::Duration dispersion = absl::Now() - first_at;
    const uint64_t trailing = (**added).payload.size() - first_bytes;
    absl::Status valid = validator_->CheckFromDownstream(**added);
    if (!valid.ok()) {
      failure = valid;
      break;
    }
    const absl::Time pushing = absl::Now();
    InboundMessage in{false, std::move(**added), absl::OkStatus(), trailing, dispersion,
                      after_stall};
    in.peer = peer_id_;
    if (!inbox_->Push(std::move(in))) return;
    after_stall = absl::Now() - pushing > kStall;
  }
  bool closed;
  {
    absl::MutexLock lock(&write_mu_);
    closed = closed_;
  }
  if (!failure.ok()) {
    GT_LOG(Error) << "refused message from downstream " << address_ << ": "
                  << failure.message();
    context_->TryCancel();
  } else if (!closed) {
    failure = absl::UnavailableError(
        absl::StrCat("downstream link to ", address_, " ended unexpectedly"));
  }
  if (!failure.ok()) {
    InboundMessage broken{false, LinkMessage(), failure};
    broken.peer = peer_id_;
    inbox_->Push(std::move(broken));
  }
}

void DownstreamLinkClient::Cancel() {
  if (context_ != nullptr) context_->TryCancel();
}

absl::Status DownstreamLinkClient::Send(const LinkMessage& message) {
  absl::MutexLock lock(&write_mu_);
  if (closed_) return absl::FailedPreconditionError("link closed");
  if (!WriteMessage(stream_.get(), message, context_.get(), write_stall_timeout_)) {
    return absl::UnavailableError(
        absl::StrCat("downstream link to ", address_, " broke while sending"));
  }
  return absl::OkStatus();
}

absl::Status DownstreamLinkClient::Close() {
  {
    absl::MutexLock lock(&write_mu_);
    if (closed_) return absl::OkStatus();
    closed_ = true;
    stream_->WritesDone();
  }
  if (reader_.joinable()) reader_.join();
  return FromGrpcStatus(stream_->Finish());
}

DownstreamLinkClient::~DownstreamLinkClient() {
  bool closed;
  {
    absl::MutexLock lock(&write_mu_);
    closed = closed_;
    closed_ = true;
  }
  if (!closed && context_ != nullptr) context_->TryCancel();
  if (reader_.joinable()) reader_.join();
  if (!closed && stream_ != nullptr) stream_->Finish();
}

}  // namespace geotrain
