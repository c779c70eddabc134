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
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace geotrain {

inline constexpr int kMaxGrpcMessageBytes = 16 << 20;
// What the coordinator receives in one message at most (a checkpoint chunk
// of kStreamPartBytes and its header fit), and the memory its server may
// hold for all calls together.
inline constexpr int kCoordinatorMaxReceiveBytes = 2 << 20;
inline constexpr size_t kCoordinatorMemoryQuotaBytes = size_t{256} << 20;
// The threads the coordinator's synchronous handlers may use at once. Plan
// streams take none (callback API); a handler stuck behind a lock holds
// one, and past this a call is answered RESOURCE_EXHAUSTED (the caller
// retries) rather than the process growing thousands of threads.
inline constexpr int kCoordinatorMaxThreads = 256;
// The payload of one message of every chunked stream (layer state,
// replica weight pushes, tied-gradient parts): far under that limit, and
// what a receiver holds of a stream beyond what it keeps.
inline constexpr size_t kStreamPartBytes = 1 << 20;
// 4 MiB covers the bandwidth-delay product of the WAN profiles in DESIGN.md
// up to Oregon-Virginia (790 Mb/s x 134 ms = 13 MB needs probing; 100 Mb/s x
// 100 ms = 1.25 MB does not); BDP probing raises it where a link needs more
// (Tokyo-London: 19 MB). It is also what a stream may buffer when its
// receiver falls behind: 16 MiB per stream showed up as up to +19% worker
// memory on a loaded machine.
inline constexpr int kHttp2WindowBytes = 4 << 20;
// Keepalive: a ping after this much silence, dead if unanswered this long.
inline constexpr int kKeepaliveTimeMs = 10000;
inline constexpr int kKeepaliveTimeoutMs = 5000;
// Deadline of control-plane unary RPCs.
inline constexpr std::chrono::milliseconds kControlRpcTimeout{5000};

// Whether a channel shares its TCP connection with the process's other
// channels to the same address (gRPC's default) or has one of its own. Bulk
// transfers (checkpoints) take their own: on one connection a small control
// call (a heartbeat) waits behind every byte of an upload already in the
// socket's buffer, for seconds on a thin uplink, and its lease runs out.
enum class Connection { kShared, kOwn };

grpc::ChannelArguments DefaultChannelArguments(Connection connection = Connection::kShared);
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           Connection connection = Connection::kShared);
void ConfigureServerBuilder(grpc::ServerBuilder* builder);

// The host part of a gRPC peer string: "ipv4:10.0.0.2:5555" ->
// "ipv4:10.0.0.2" (the port changes with every connection, the host does not).
std::string PeerHost(const std::string& grpc_peer);

// HOST:PORT parsed strictly: a DNS name or an IPv4 address, or a whole
// IPv6 address in brackets ("[::1]:7000"); a decimal port in 1-65535 (0
// too, meaning any, when `allow_any_port`); at most 256 printable bytes.
// INVALID_ARGUMENT saying what does not fit. gRPC itself would take
// "127.0.0.1:99999" as some other port, and "[::1" as something.
absl::Status CheckHostPort(const std::string& address, bool allow_any_port = false);
// CheckHostPort for a flag: the message names `flag`.
absl::Status ValidateHostPort(const std::string& flag, const std::string& address,
                              bool allow_any_port);

// now + timeout, for ClientContext::set_deadline.
// `base` times a random factor in [0.5, 1.5): the retries of many clients
// (a thousand workers whose coordinator restarted) spread out instead of
// arriving together. Thread-safe.
absl::Duration Jittered(absl::Duration base);

std::chrono::system_clock::time_point DeadlineFromNow(
    std::chrono::milliseconds timeout);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_RPC_OPTIONS_H_
