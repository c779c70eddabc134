#include "common/stage_probe.h"

#include <algorithm>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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

absl::StatusOr<LinkMeasurement> MeasureStage(const std::string& address,
                                             const std::string& member_id,
                                             const TransportSecurity& security,
                                             absl::Duration deadline, size_t payload_bytes) {
  if (payload_bytes > kMaxMeasurePayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("measure payload of ", payload_bytes,
                                                   " bytes: at most ", kMaxMeasurePayloadBytes));
  }
  auto stub = StageStub(address, member_id, security);
  const auto until = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline);
  // Who answers (and the connection, TLS included, out of the timings).
  {
    grpc::ClientContext context;
    context.set_deadline(until);
    context.set_wait_for_ready(true);
    v1::ProbeResponse response;
    const grpc::Status status = stub->Probe(&context, v1::ProbeRequest(), &response);
    if (!status.ok()) return Unreachable(status, member_id, deadline);
    if (!member_id.empty() && !response.worker_id().empty() &&
        response.worker_id() != member_id) {
      return absl::UnavailableError(
          absl::StrCat("worker '", response.worker_id().substr(0, 128), "' answers there"));
    }
  }
  auto timed_call = [&](const v1::MeasureRequest& request) -> absl::StatusOr<double> {
    grpc::ClientContext context;
    context.set_deadline(until);
    v1::MeasureResponse response;
    const absl::Time start = absl::Now();
    const grpc::Status status = stub->Measure(&context, request, &response);
    if (!status.ok()) return Unreachable(status, member_id, deadline);
    if (response.received() != request.payload().size()) {
      return absl::UnavailableError("the member did not receive the whole payload");
    }
    return absl::ToDoubleSeconds(absl::Now() - start);
  };
  LinkMeasurement measured;
  measured.rtt_s = 1e9;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<double> took = timed_call(v1::MeasureRequest());
    if (!took.ok()) return took.status();
    measured.rtt_s = std::min(measured.rtt_s, *took);
  }
  if (payload_bytes > 0) {
    v1::MeasureRequest request;
    request.mutable_payload()->assign(payload_bytes, '\x5a');
    absl::StatusOr<double> took = timed_call(request);
    if (!took.ok()) return took.status();
    // At least a tenth of the call's time counts as transfer: a payload that
    // fits in the windows already open still says something.
    const double transfer = std::max(*took - measured.rtt_s, 0.1 * *took);
    measured.rate_bps = payload_bytes * 8.0 / transfer;
  }
  return measured;
}

}  // namespace geotrain
