#include "common/stage_probe.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/rpc_options.h"
#include "geotrain/v1/stage.grpc.pb.h"

namespace geotrain {

absl::StatusOr<absl::Duration> ProbeStage(const std::string& address,
                                          const std::string& member_id,
                                          const TransportSecurity& security,
                                          absl::Duration deadline) {
  grpc::ChannelArguments args = DefaultChannelArguments();
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a dial-back: no shared connection
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      security.insecure ? grpc::InsecureChannelCredentials() : MakeChannelCredentials(security);
  if (!security.insecure && !member_id.empty()) args.SetSslTargetNameOverride(member_id);
  auto stub = v1::Stage::NewStub(grpc::CreateCustomChannel(address, credentials, args));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(deadline));
  context.set_wait_for_ready(true);  // keep trying to connect until the deadline
  v1::ProbeResponse response;
  const absl::Time start = absl::Now();
  const grpc::Status status = stub->Probe(&context, v1::ProbeRequest(), &response);
  if (!status.ok()) {
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
  if (!member_id.empty() && !response.worker_id().empty() && response.worker_id() != member_id) {
    return absl::UnavailableError(
        absl::StrCat("worker '", response.worker_id().substr(0, 128), "' answers there"));
  }
  return absl::Trunc(absl::Now() - start, absl::Milliseconds(1));
}

}  // namespace geotrain
