#include "common/rpc_options.h"

#include <arpa/inet.h>

#include <algorithm>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace geotrain {

grpc::ChannelArguments DefaultChannelArguments(Connection connection) {
  grpc::ChannelArguments args;
  // A subchannel pool of the channel's own: a TCP connection no other
  // channel shares.
  if (connection == Connection::kOwn) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
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

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, Connection connection) {
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   DefaultChannelArguments(connection));
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

namespace {
constexpr size_t kMaxAddressBytes = 256;
}  // namespace

absl::Status CheckHostPort(const std::string& address, bool allow_any_port) {
  auto refused = [&address](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "address '", address.substr(0, kMaxAddressBytes), "' is not HOST:PORT (", why, ")"));
  };
  if (address.empty() || address.size() > kMaxAddressBytes ||
      !std::all_of(address.begin(), address.end(),
                   [](unsigned char c) { return c > 0x20 && c < 0x7f; })) {
    return refused("1-256 printable bytes");
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return refused("no port");
  const std::string host = address.substr(0, colon);
  const std::string port_text = address.substr(colon + 1);
  int port = 0;
  if (port_text.empty() || port_text.size() > 5 ||
      port_text.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(port_text, &port) || port < (allow_any_port ? 0 : 1) || port > 65535) {
    return refused(allow_any_port ? "a port of 0-65535" : "a port of 1-65535");
  }
  if (!host.empty() && host.front() == '[') {
    // An IPv6 literal, whole and bracketed.
    in6_addr ip6;
    if (host.size() < 3 || host.back() != ']' ||
        inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), &ip6) != 1) {
      return refused("an IPv6 host is a whole address in brackets, e.g. [::1]:7000");
    }
    return absl::OkStatus();
  }
  // A DNS name or an IPv4 address: letters, digits, '-', '_' and dots
  // between non-empty labels.
  if (host.empty() || host.size() > 253 || host.front() == '.' || host.back() == '.' ||
      host.find("..") != std::string::npos ||
      host.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") !=
          std::string::npos) {
    return refused("a host name, an IPv4 address or a bracketed IPv6 address");
  }
  return absl::OkStatus();
}

absl::Status ValidateHostPort(const std::string& flag, const std::string& address,
                              bool allow_any_port) {
  if (absl::Status valid = CheckHostPort(address, allow_any_port); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", valid.message()));
  }
  return absl::OkStatus();
}

absl::Duration Jittered(absl::Duration base) {
  thread_local std::mt19937 random(std::random_device{}());
  return base * std::uniform_real_distribution<double>(0.5, 1.5)(random);
}

std::chrono::system_clock::time_point DeadlineFromNow(
    std::chrono::milliseconds timeout) {
  return std::chrono::system_clock::now() + timeout;
}

}  // namespace geotrain
