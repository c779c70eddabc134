#include "worker/link_dialer.h"

#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/tcp_socket.h"
#include "common/tls_session.h"
#include "worker/link_hello.h"
#include "worker/stall_watchdog.h"

namespace geotrain {
namespace {

constexpr absl::Duration kTlsHandshakeTimeout = absl::Seconds(10);

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


struct Opened {
  std::unique_ptr<LinkTransport> transport;
  std::string identity;  // the peer's certified id (relayed TLS); "" otherwise
};

// HELLO out, answer in, on a transport this end opened.
absl::Status ExchangeHello(LinkTransport* transport, const LinkMessage& hello,
                           const LinkOptions& options) {
  IncomingFrame ack;
  if (!WriteLinkMessage(transport, std::make_shared<const LinkMessage>(hello),
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
  const bool upstream_end = PlaysUpstreamEnd(target);
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

bool PlaysUpstreamEnd(const DialTarget& target) {
  switch (target.peer.side) {
    case PeerSide::kDownstream: return true;
    case PeerSide::kUpstream: return false;
    case PeerSide::kReplica:
      return target.planned != nullptr && target.planned->upstream_worker() == target.self_id;
  }
  return false;
}

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
    if (!PlaysUpstreamEnd(target)) {
      // The upstream end speaks first; answer it as if it had dialled.
      ASSIGN_OR_RETURN(end, service->Answer(std::move(opened.transport), opened.identity,
                                            opened.identity.empty() ? target.peer.id
                                                                    : opened.identity));
      if (end->peer().id != target.peer.id || end->peer().side != target.peer.side) {
        end->EndOnPurpose();
        if (end->peer().side == PeerSide::kUpstream) {
          service->upstream_links()->Unregister(end.get());
        }
        return absl::PermissionDeniedError(absl::StrCat(
            "the relayed link meant for '", target.peer.id, "' came from '", end->peer().id, "'"));
      }
      end->StartReader();
      return end;
    }
    if (absl::Status exchanged = ExchangeHello(opened.transport.get(), hello, options);
        !exchanged.ok()) {
      return absl::Status(exchanged.code(),
                          absl::StrCat("the ", PeerSideName(target.peer.side), " link to '",
                                       target.peer.id, "' ",
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