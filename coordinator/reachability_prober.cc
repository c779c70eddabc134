#include "coordinator/reachability_prober.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/rpc_options.h"
#include "common/tcp_socket.h"
#include "geotrain/v1/stage.grpc.pb.h"

namespace geotrain {
namespace {

std::string PortOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? "" : address.substr(colon + 1);
}

v1::Reachability Reached(const std::string& detail) {
  v1::Reachability r;
  r.set_known(true);
  r.set_reachable(true);
  r.set_detail(detail);
  return r;
}

v1::Reachability NotReached(const std::string& address, const std::string& reason) {
  v1::Reachability r;
  r.set_known(true);
  r.set_reachable(false);
  r.set_detail(UnreachableAdvice(address, reason));
  return r;
}

}  // namespace

std::string UnreachableAdvice(const std::string& address, const std::string& reason) {
  return absl::StrCat(
      "the coordinator could not dial ", address, " (", reason,
      "). This member still joins: its neighbours cannot dial it, so it dials them, or a "
      "relay joins both. To accept links directly, make ", address,
      " reachable from the other hosts (forward TCP port ", PortOf(address),
      " to this host and open it in its firewall) or set --advertise=HOST:PORT to an address "
      "that is");
}

v1::Reachability ReachabilityProber::Probe(const std::string& address,
                                           const std::string& member_id,
                                           v1::MemberRole role) const {
  if (!options_.enabled) return v1::Reachability();
  return role == v1::MEMBER_ROLE_RELAY ? ProbeRelay(address) : ProbeWorker(address, member_id);
}

v1::Reachability ReachabilityProber::ProbeWorker(const std::string& address,
                                                 const std::string& member_id) const {
  // A fresh channel per probe (no connection reuse): this is a dial-back.
  grpc::ChannelArguments args = DefaultChannelArguments();
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      options_.security.insecure ? grpc::InsecureChannelCredentials()
                                 : MakeChannelCredentials(options_.security);
  if (!options_.security.insecure && !member_id.empty()) {
    args.SetSslTargetNameOverride(member_id);
  }
  auto channel = grpc::CreateCustomChannel(address, credentials, args);
  auto stub = v1::Stage::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(options_.deadline));
  context.set_wait_for_ready(true);  // wait for the connection up to the deadline
  v1::ProbeResponse response;
  const absl::Time start = absl::Now();
  const grpc::Status status = stub->Probe(&context, v1::ProbeRequest(), &response);
  const absl::Duration took = absl::Now() - start;
  if (!status.ok()) {
    std::string reason = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                             ? absl::StrCat("no answer within ", absl::FormatDuration(options_.deadline))
                             : status.error_message();
    if (absl::StrContains(status.error_message(), "andshake") ||
        absl::StrContains(status.error_message(), "ertificate")) {
      reason = absl::StrCat("the TLS handshake failed: what answers there is not ",
                            member_id.empty() ? "this worker" : member_id, " (",
                            status.error_message(), ")");
    }
    return NotReached(address, reason);
  }
  if (!member_id.empty() && !response.worker_id().empty() && response.worker_id() != member_id) {
    return NotReached(address, absl::StrCat("worker '", response.worker_id().substr(0, 128),
                                            "' answers there"));
  }
  return Reached(absl::StrCat("coordinator dialled ", address,
                              options_.security.insecure ? " (plaintext)" : " over TLS", " in ",
                              absl::FormatDuration(absl::Trunc(took, absl::Milliseconds(1)))));
}

v1::Reachability ReachabilityProber::ProbeRelay(const std::string& address) const {
  const absl::Time start = absl::Now();
  absl::StatusOr<TcpSocket> socket = TcpSocket::Connect(address, options_.deadline);
  if (!socket.ok()) return NotReached(address, std::string(socket.status().message()));
  socket->SetTimeouts(options_.deadline, options_.deadline);
  const std::string probe = "GTRELAY1 probe\n";
  if (!socket->WriteAll(probe.data(), probe.size())) {
    return NotReached(address, "the connection closed at once");
  }
  absl::StatusOr<std::string> answer = socket->ReadLine(256);
  if (!answer.ok() || !absl::StartsWith(*answer, "GTRELAY1 relay")) {
    return NotReached(address, answer.ok() ? "something other than a geotrain-relay answers"
                                           : std::string(answer.status().message()));
  }
  return Reached(absl::StrCat("coordinator reached the relay at ", address, " in ",
                              absl::FormatDuration(absl::Trunc(absl::Now() - start,
                                                               absl::Milliseconds(1)))));
}

}  // namespace geotrain
