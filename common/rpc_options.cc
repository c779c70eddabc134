#include "common/rpc_options.h"

#include "absl/strings/str_cat.h"

namespace geotrain {

grpc::ChannelArguments DefaultChannelArguments() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kHttp2WindowBytes);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 1);
  // Reconnect quickly after a peer restarts.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   DefaultChannelArguments());
}

void ConfigureServerBuilder(grpc::ServerBuilder* builder) {
  builder->SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  builder->SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              5000);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kHttp2WindowBytes);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 1);
}

std::string PeerHost(const std::string& grpc_peer) {
  std::string host = grpc_peer;
  const size_t colon = host.rfind(':');
  const size_t scheme = host.find(':');
  if (colon != std::string::npos && colon != scheme) host.resize(colon);
  return host;
}

absl::Status ValidateHostPort(const std::string& flag, const std::string& address,
                              bool allow_any_port) {
  const size_t colon = address.rfind(':');
  const std::string port = colon == std::string::npos ? "" : address.substr(colon + 1);
  const bool digits = !port.empty() && port.size() <= 5 &&
                      port.find_first_not_of("0123456789") == std::string::npos;
  const int number = digits ? std::stoi(port) : -1;
  if (colon == std::string::npos || colon == 0 || !digits || number > 65535 ||
      (number == 0 && !allow_any_port)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", address.substr(0, 256), ": expected HOST:PORT with a port in [",
        allow_any_port ? 0 : 1, ", 65535]"));
  }
  return absl::OkStatus();
}

std::chrono::system_clock::time_point DeadlineFromNow(
    std::chrono::milliseconds timeout) {
  return std::chrono::system_clock::now() + timeout;
}

}  // namespace geotrain
