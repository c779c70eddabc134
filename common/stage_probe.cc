#include "common/stage_probe.h"

#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/rpc_options.h"
#include "geotrain/v1/stage.grpc.pb.h"

namespace geotrain {

namespace {

// A fresh connection to a member's Stage service (a dial-back: no shared
// connection), checking with TLS that its certificate names `member_id`.
std::unique_ptr<v1::Stage::Stub> StageStub(const std::string& address,
                                           const std::string& member_id,
                                           const TransportSecurity& security) {
  grpc::ChannelArguments args = DefaultChannelArguments();
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      security.insecure ? grpc::InsecureChannelCredentials() : MakeChannelCredentials(security);
  if (!security.insecure && !member_id.empty()) args.SetSslTargetNameOverride(member_id);
  return v1::Stage::NewStub(grpc::CreateCustomChannel(address, credentials, args));
}

// A failed call in words.
absl::Status Unreachable(const grpc::Status& status, const std::string& member_id,
                         absl::Duration deadline) {
  const std::string& message = status.error_message();
  if (absl::StrContains(message, "andshake") || absl::StrContains(message, "ertificate")) {
    return absl::UnavailableError(absl::StrCat(
        "the TLS handshake failed: what answers there is not ",
        member_id.empty() ? "this worker" : member_id, " (", message, ")"));
  }
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::UnavailableError(
        absl::StrCat("no answer within ", absl::FormatDuration(deadline)));
  }
  return absl::UnavailableError(message);
}

}  // namespace

absl::StatusOr<absl::Duration> ProbeStage(const std::string& address,
                                          const std::string& member_id,
                                          const TransportSecurity& security,
                                          absl::Duration deadline) {
  auto stub = StageStub(address, member_id, security);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
  context.set_wait_for_ready(true);  // keep trying to connect until the deadline
  v1::ProbeResponse response;
  const absl::Time start = absl::Now();
  const grpc::Status status = stub->Probe(&context, v1::ProbeRequest(), &response);
  if (!status.ok()) return Unreachable(status, member_id, deadline);
  if (!member_id.empty() && !response.worker_id().empty() && response.worker_id() != member_id) {
    return absl::UnavailableError(
        absl::StrCat("worker '", response.worker_id().substr(0, 128), "' answers there"));
  }
  return absl::Trunc(absl::Now() - start, absl::Milliseconds(1));
}

namespace {

// A connection to `member_id` at `address` whose answer named it (the
// connection, TLS included, made before any timing), and the least of 3
// empty Measure calls on it.
struct MeasuredConnection {
  std::unique_ptr<v1::Stage::Stub> stub;
  double rtt_s = 0;
};

absl::StatusOr<MeasuredConnection> ConnectToMeasure(
    const std::string& address, const std::string& member_id, const TransportSecurity& security,
    std::chrono::system_clock::time_point until, absl::Duration deadline) {
  MeasuredConnection connection;
  connection.stub = StageStub(address, member_id, security);
  {
    grpc::ClientContext context;
    context.set_deadline(until);
    context.set_wait_for_ready(true);
    v1::ProbeResponse response;
    const grpc::Status status = connection.stub->Probe(&context, v1::ProbeRequest(), &response);
    if (!status.ok()) return Unreachable(status, member_id, deadline);
    if (!member_id.empty() && !response.worker_id().empty() &&
        response.worker_id() != member_id) {
      return absl::UnavailableError(
          absl::StrCat("worker '", response.worker_id().substr(0, 128), "' answers there"));
    }
  }
  connection.rtt_s = 1e9;
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    context.set_deadline(until);
    v1::MeasureResponse response;
    const absl::Time start = absl::Now();
    const grpc::Status status =
        connection.stub->Measure(&context, v1::MeasureRequest(), &response);
    if (!status.ok()) return Unreachable(status, member_id, deadline);
    connection.rtt_s = std::min(connection.rtt_s, absl::ToDoubleSeconds(absl::Now() - start));
  }
  return connection;
}

// Bits over a transfer's time: at least a tenth of the call's time counts as
// transfer, so a payload that fits in the windows already open still says
// something.
double RateOf(double bytes, double took_s, double rtt_s) {
  return bytes * 8.0 / std::max(took_s - rtt_s, 0.1 * took_s);
}

absl::Status CheckPayloadBytes(size_t payload_bytes) {
  if (payload_bytes > kMaxMeasurePayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("measure payload of ", payload_bytes,
                                                   " bytes: at most ", kMaxMeasurePayloadBytes));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LinkMeasurement> MeasureStage(const std::string& address,
                                             const std::string& member_id,
                                             const TransportSecurity& security,
                                             absl::Duration deadline, size_t payload_bytes) {
  if (absl::Status bytes = CheckPayloadBytes(payload_bytes); !bytes.ok()) return bytes;
  const auto until = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline);
  absl::StatusOr<MeasuredConnection> connection =
      ConnectToMeasure(address, member_id, security, until, deadline);
  if (!connection.ok()) return connection.status();
  LinkMeasurement measured;
  measured.rtt_s = connection->rtt_s;
  if (payload_bytes > 0) {
    grpc::ClientContext context;
    context.set_deadline(until);
    v1::MeasureRequest request;
    request.mutable_payload()->assign(payload_bytes, '\x5a');
    v1::MeasureResponse response;
    const absl::Time start = absl::Now();
    const grpc::Status status = connection->stub->Measure(&context, request, &response);
    if (!status.ok()) return Unreachable(status, member_id, deadline);
    if (response.received() != payload_bytes) {
      return absl::UnavailableError("the member did not receive the whole payload");
    }
    measured.rate_bps =
        RateOf(payload_bytes, absl::ToDoubleSeconds(absl::Now() - start), measured.rtt_s);
  }
  return measured;
}

absl::StatusOr<AccessMeasurement> MeasureAccess(const std::vector<MeasureTarget>& targets,
                                                const TransportSecurity& security,
                                                absl::Duration deadline, size_t payload_bytes) {
  if (targets.empty() || targets.size() > kMaxAccessPeers) {
    return absl::InvalidArgumentError(absl::StrCat("an access measurement takes 1 to ",
                                                   kMaxAccessPeers, " peers, not ",
                                                   targets.size()));
  }
  if (payload_bytes == 0) return absl::InvalidArgumentError("an empty measure payload");
  if (absl::Status bytes = CheckPayloadBytes(payload_bytes); !bytes.ok()) return bytes;
  const auto until = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline);
  std::vector<MeasuredConnection> connections;
  double rtt_s = 0;  // the slowest peer's: every transfer has to end
  for (const MeasureTarget& target : targets) {
    absl::StatusOr<MeasuredConnection> connection =
        ConnectToMeasure(target.address, target.member_id, security, until, deadline);
    if (!connection.ok()) {
      return absl::UnavailableError(
          absl::StrCat(target.member_id, ": ", connection.status().message()));
    }
    rtt_s = std::max(rtt_s, connection->rtt_s);
    connections.push_back(*std::move(connection));
  }
  // Every transfer of a direction at once, each on a thread of its own
  // waiting for the same start; the direction's time runs from that start
  // to the last one's end.
  const size_t n = connections.size();
  auto all_at_once = [&](bool send) -> absl::StatusOr<double> {
    std::vector<grpc::Status> statuses(n);
    std::vector<size_t> moved(n, 0);
    absl::Notification start;
    std::vector<std::thread> threads;
    for (size_t i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        v1::MeasureRequest request;
        if (send) {
          request.mutable_payload()->assign(payload_bytes, '\x5a');
        } else {
          request.set_reply_bytes(static_cast<uint32_t>(payload_bytes));
        }
        grpc::ClientContext context;
        context.set_deadline(until);
        v1::MeasureResponse response;
        start.WaitForNotification();
        statuses[i] = connections[i].stub->Measure(&context, request, &response);
        moved[i] = send ? response.received() : response.payload().size();
      });
    }
    const absl::Time began = absl::Now();
    start.Notify();
    for (std::thread& t : threads) t.join();
    const double took_s = absl::ToDoubleSeconds(absl::Now() - began);
    for (size_t i = 0; i < n; ++i) {
      if (!statuses[i].ok()) {
        return absl::UnavailableError(absl::StrCat(
            targets[i].member_id, ": ", Unreachable(statuses[i], targets[i].member_id, deadline)
                                            .message()));
      }
      if (moved[i] != payload_bytes) {
        return absl::UnavailableError(absl::StrCat(
            targets[i].member_id, ": ", send ? "did not receive" : "did not send",
            " the whole payload (", moved[i], " of ", payload_bytes, " bytes)"));
      }
    }
    return RateOf(static_cast<double>(n * payload_bytes), took_s, rtt_s);
  };
  AccessMeasurement measured;
  absl::StatusOr<double> up = all_at_once(/*send=*/true);
  if (!up.ok()) return up.status();
  measured.uplink_bps = *up;
  absl::StatusOr<double> down = all_at_once(/*send=*/false);
  if (!down.ok()) return down.status();
  measured.downlink_bps = *down;
  return measured;
}

}  // namespace geotrain
