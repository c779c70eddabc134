// Small blocking TCP helpers (POSIX sockets) for the relay and for links
// through it: connect with a deadline, listen, whole reads and writes, and
// one-line handshakes. Every blocking call is bounded by the socket's
// timeouts or ends when another thread calls Shutdown(). Torch-free.
#ifndef GEOTRAIN_COMMON_TCP_SOCKET_H_
#define GEOTRAIN_COMMON_TCP_SOCKET_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace geotrain {

// Owns one socket descriptor. Move-only.
class TcpSocket {
 public:
  TcpSocket() = default;
  explicit TcpSocket(int fd) : fd_(fd) {}
  TcpSocket(TcpSocket&& other) noexcept : fd_(other.release()) {}
  TcpSocket& operator=(TcpSocket&& other) noexcept;
  TcpSocket(const TcpSocket&) = delete;
  TcpSocket& operator=(const TcpSocket&) = delete;
  ~TcpSocket();

  // Connects to HOST:PORT (a name, IPv4 or [IPv6]) within `timeout`.
  // UNAVAILABLE naming the address and the OS's reason (refused, no route,
  // timed out) otherwise.
  static absl::StatusOr<TcpSocket> Connect(const std::string& address, absl::Duration timeout);

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  int release();

  // Every blocking read (write) fails after this long without progress;
  // InfiniteDuration: never.
  void SetTimeouts(absl::Duration read, absl::Duration write);
  // TCP keepalive: probes after `idle` of silence, dead after 3 unanswered
  // probes `interval` apart. Also TCP_NODELAY.
  void SetKeepalive(absl::Duration idle, absl::Duration interval);

  // Writes all of `data`. False when the connection broke or timed out.
  bool WriteAll(const void* data, size_t size);
  // Reads exactly `size` bytes. False at end of stream, on error or timeout.
  bool ReadExactly(void* data, size_t size);
  // Reads up to `size`; 0 at end of stream, -1 on error or timeout.
  long ReadSome(void* data, size_t size);
  // Reads one line ending in '\n' of at most `max_bytes` (without the '\n'),
  // by `deadline` in all (besides the socket's per-read timeout).
  absl::StatusOr<std::string> ReadLine(size_t max_bytes,
                                       absl::Time deadline = absl::InfiniteFuture());

  // Both directions (SHUT_RDWR): blocked reads and writes in other threads
  // return at once. Thread-safe; the descriptor stays open until destruction.
  void Shutdown();
  // Our direction only (SHUT_WR): the peer reads end of stream.
  void ShutdownWrites();
  // "ipv4:198.51.100.3:40112", as gRPC names peers.
  std::string PeerName() const;

 private:
  int fd_ = -1;
};

// A listening socket on HOST:PORT (port 0: any; see port()).
class TcpListener {
 public:
  static absl::StatusOr<TcpListener> Listen(const std::string& address, int backlog = 128);
  TcpListener(TcpListener&&) = default;
  TcpListener& operator=(TcpListener&&) = default;

  int port() const { return port_; }
  // Waits for a connection; UNAVAILABLE once Shutdown() was called.
  absl::StatusOr<TcpSocket> Accept();
  void Shutdown();

 private:
  TcpListener() = default;
  TcpSocket socket_;
  int port_ = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_TCP_SOCKET_H_
