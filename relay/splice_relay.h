// The data path of geotrain-relay: pairs two outbound TCP connections that
// present the same rendezvous (one "up", one "down" end of a planned link)
// and copies bytes between them until both directions end. The bytes are
// the two workers' own TLS session (common/tls_session.h): the relay cannot
// read or alter them, only drop them.
//
// Protocol, one line each way, then raw bytes:
//   end   -> relay: "GTRELAY1 <rendezvous> up|down <proof>\n"
//   relay -> end:   "OK\n" once the other end is there, or "ERR <why>\n"
//   probe -> relay: "GTRELAY1 probe\n";  relay -> probe: "GTRELAY1 relay <id>\n"
//
// Only rendezvous of the current plan's links through this relay are
// paired (SetLinks), and only ends that present their own side's proof (a
// secret the coordinator gives that end alone). The first end of a side
// waits; another for the same side is refused while the first is still
// connected, and a pair once spliced stays: nobody is displaced. Everything a stranger can hold is bounded: the time to
// send the greeting, ends waiting for their pair (in all and per source
// host), the wait itself, and the pairs spliced at once. Thread-safe; one
// thread per connection.
#ifndef GEOTRAIN_RELAY_SPLICE_RELAY_H_
#define GEOTRAIN_RELAY_SPLICE_RELAY_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tcp_socket.h"

namespace geotrain {

struct SpliceRelayOptions {
  std::string listen = "0.0.0.0:7400";
  absl::Duration greeting_timeout = absl::Seconds(5);
  // How long one end waits for the other, and for a rendezvous the relay
  // has not seen in a plan yet (the worker may have seen the plan first).
  absl::Duration pair_timeout = absl::Seconds(60);
  absl::Duration unknown_rendezvous_wait = absl::Seconds(10);
  int max_waiting = 256;
  int max_waiting_per_source = 32;
  int max_pairs = 512;
  size_t buffer_bytes = 256 << 10;
  // Keepalive on both legs: a vanished end is found and its pair ended.
  absl::Duration keepalive_idle = absl::Seconds(10);
  absl::Duration keepalive_interval = absl::Seconds(2);
};

struct SpliceRelayStats {
  int64_t pairs_total = 0;
  int pairs_open = 0;
  int waiting = 0;
  uint64_t bytes_spliced = 0;
  int64_t refused = 0;
};

class SpliceRelay {
 public:
  static absl::StatusOr<std::unique_ptr<SpliceRelay>> Start(SpliceRelayOptions options);
  ~SpliceRelay();

  int port() const { return port_; }
  void SetIdentity(const std::string& id);
  // The rendezvous this relay pairs (replacing the previous set). Ends of a
  // rendezvous that left the set keep waiting until their timeout; spliced
  // pairs run on (their workers end them at a re-plan).
  struct Proofs {
    std::string up;
    std::string down;
  };
  void SetLinks(std::map<std::string, Proofs> links);
  void Shutdown();
  SpliceRelayStats stats() const;

 private:
  struct Waiting {
    TcpSocket* socket = nullptr;   // owned by the waiting handler
    std::string source;
    bool paired = false;
    bool gone = false;  // its peer closed it; another connection took its place
    TcpSocket partner;             // set when paired: the handler splices
  };

  explicit SpliceRelay(SpliceRelayOptions options) : options_(std::move(options)) {}
  void AcceptLoop();
  void Handle(TcpSocket socket);
  void Splice(TcpSocket& a, TcpSocket& b);

  const SpliceRelayOptions options_;
  std::unique_ptr<TcpListener> listener_;
  int port_ = 0;
  std::thread acceptor_;
  mutable absl::Mutex mu_;
  std::string identity_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Proofs> links_ ABSL_GUARDED_BY(mu_);
  // rendezvous + "/" + side -> the end waiting there.
  std::map<std::string, Waiting*> waiting_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> waiting_per_source_ ABSL_GUARDED_BY(mu_);
  std::set<int> open_ ABSL_GUARDED_BY(mu_);  // descriptors of every connection, for Shutdown
  int handlers_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  SpliceRelayStats stats_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> bytes_{0};
};

}  // namespace geotrain

#endif  // GEOTRAIN_RELAY_SPLICE_RELAY_H_
