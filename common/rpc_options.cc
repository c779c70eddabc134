#include "common/rpc_options.h"

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

std::chrono::system_clock::time_point DeadlineFromNow(
    std::chrono::milliseconds timeout) {
  return std::chrono::system_clock::now() + timeout;
}

}  // namespace geotrain
