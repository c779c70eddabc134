// Channel and server settings shared by every geotrain endpoint.
//
// - Message size limits are explicit on both ends (gRPC's default receive
//   limit is 4 MiB): tensors travel as ~1 MiB frames, so 16 MiB leaves room
//   for headers while refusing absurd messages early.
// - Clients send keepalive pings (10 s, 5 s timeout) so that a silent peer is
//   found without waiting for a deadline; servers permit pings that often.
// - HTTP/2 flow-control windows start at kHttp2WindowBytes instead of 64 KiB,
//   with BDP probing on so that they may grow further: a window smaller than
//   the bandwidth-delay product caps a stream at window / round trip (64 KiB
//   over a 100 ms round trip is 5 Mb/s, whatever the link).
#ifndef GEOTRAIN_COMMON_RPC_OPTIONS_H_
#define GEOTRAIN_COMMON_RPC_OPTIONS_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

namespace geotrain {

inline constexpr int kMaxGrpcMessageBytes = 16 << 20;
// 16 MiB covers the bandwidth-delay product of every WAN profile in
// DESIGN.md up to Tokyo-London (366 Mb/s x 420 ms round trip = 19 MB, which
// BDP probing reaches), at a cost of at most that much buffered per stream.
inline constexpr int kHttp2WindowBytes = 16 << 20;
// Deadline of control-plane unary RPCs.
inline constexpr std::chrono::milliseconds kControlRpcTimeout{5000};

grpc::ChannelArguments DefaultChannelArguments();
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);
void ConfigureServerBuilder(grpc::ServerBuilder* builder);

// now + timeout, for ClientContext::set_deadline.
std::chrono::system_clock::time_point DeadlineFromNow(
    std::chrono::milliseconds timeout);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_RPC_OPTIONS_H_
