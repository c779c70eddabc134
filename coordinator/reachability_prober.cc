#include "coordinator/reachability_prober.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/rpc_options.h"
#include "common/stage_probe.h"
#include "common/tcp_socket.h"

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
  absl::StatusOr<absl::Duration> took =
      ProbeStage(address, member_id, options_.security, options_.deadline);
  if (!took.ok()) return NotReached(address, std::string(took.status().message()));
  return Reached(absl::StrCat("coordinator dialled ", address,
                              options_.security.insecure ? " (plaintext)" : " over TLS", " in ",
                              absl::FormatDuration(*took)));
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
