// A user-space TCP relay that makes a loopback connection behave like a WAN
// link: every accepted connection is forwarded to `target`, each direction
// through its own LinkShaper (rate, delay, queue cap), with injectable
// faults (close after N bytes, blackhole). Needs neither netem nor tbf.
//
// Back-pressure: a direction reads from its source only while its queue has
// room, so a sender that outruns the link fills its TCP window and blocks,
// as it would on a real bottleneck.
//
// Threading: one accept thread, and per connection one reader and one
// writer thread per direction. Public methods are thread-safe.
#ifndef GEOTRAIN_DEPLOY_WAN_LAB_TCP_RELAY_H_
#define GEOTRAIN_DEPLOY_WAN_LAB_TCP_RELAY_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "deploy/wan-lab/link_shaper.h"

namespace geotrain::wanlab {

struct RelayOptions {
  std::string listen = "127.0.0.1:0";  // HOST:PORT; port 0 picks one
  std::string target;                  // HOST:PORT
  LinkShape shape;                     // applied to each direction
  int64_t close_after_bytes = 0;       // per connection, both directions; 0: never
  bool blackhole = false;              // start as a blackhole
  int socket_buffer_bytes = 128 * 1024;  // kernel buffers on relay sockets
};

struct RelayTotals {
  int64_t connections = 0;
  int64_t bytes_forwarded = 0;
  int64_t bytes_dropped = 0;  // swallowed by the blackhole
};

class TcpRelay {
 public:
  explicit TcpRelay(RelayOptions options);
  ~TcpRelay();  // Stop()s
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  // Binds and starts accepting. Returns the port listened on.
  absl::StatusOr<int> Start();

  // While on, bytes are read from both ends and thrown away, and a close
  // from either end is not passed on: connections stay open, nothing
  // arrives (a silent route, not a reset).
  void SetBlackhole(bool on) { blackhole_ = on; }
  bool blackhole() const { return blackhole_; }

  // A new shape for both directions of every connection, open or future,
  // from the next chunk each reads (geotrain-linkem's SIGHUP).
  void SetShape(const LinkShape& shape);
  LinkShape shape() const;

  // Closes the listener and every connection; joins all threads.
  void Stop();

  RelayTotals totals() const;

 private:
  class Connection;
  void AcceptLoop();
  void ReapFinished();

  const RelayOptions options_;
  mutable std::mutex shape_mu_;
  LinkShape shape_;                        // guarded by shape_mu_
  std::atomic<int64_t> shape_generation_{0};  // bumped by SetShape
  std::atomic<bool> blackhole_;
  std::atomic<bool> stopping_{false};
  int listen_fd_ = -1;
  std::thread accept_thread_;
  mutable std::mutex mu_;
  std::list<std::unique_ptr<Connection>> connections_;  // guarded by mu_
  std::atomic<int64_t> connections_total_{0};
  std::atomic<int64_t> bytes_forwarded_{0};
  std::atomic<int64_t> bytes_dropped_{0};
};

// Splits "HOST:PORT" (IPv4 or a name that resolves to IPv4).
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address);

}  // namespace geotrain::wanlab

#endif  // GEOTRAIN_DEPLOY_WAN_LAB_TCP_RELAY_H_
