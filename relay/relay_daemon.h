// geotrain-relay: a member of the cluster that holds no stage and splices
// links between workers that cannot dial each other (both behind NAT). It
// enrolls with a token like a worker (its certificate names its member id),
// joins with role RELAY (the coordinator dials its listener back), renews
// its lease, and watches the plan for the links assigned to it: only their
// rendezvous are paired (SpliceRelay). It is never on the coordinator's
// path and cannot read what it splices (end-to-end TLS between workers).
#ifndef GEOTRAIN_RELAY_RELAY_DAEMON_H_
#define GEOTRAIN_RELAY_RELAY_DAEMON_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transport_security.h"
#include "relay/splice_relay.h"
#include "worker/coordinator_client.h"

namespace geotrain {

struct RelayDaemonOptions {
  std::string coordinator = "127.0.0.1:7070";
  std::string listen = "0.0.0.0:7400";
  std::string advertise;  // HOST[:PORT] workers dial; default: from listen
  std::string name;
  bool insecure = false;
  std::string token;
  std::string state_dir;
  std::string tls_server_name = kCoordinatorServerName;
  absl::Duration join_timeout = absl::InfiniteDuration();
  SpliceRelayOptions splice;
};

class RelayDaemon {
 public:
  explicit RelayDaemon(RelayDaemonOptions options);
  ~RelayDaemon();
  // Runs until the job ends (OK), Stop() (CANCELLED) or a refusal.
  absl::Status Run();
  void Stop();  // thread-safe

 private:
  absl::Status Join();
  void HeartbeatLoop(int interval_ms);

  RelayDaemonOptions options_;
  std::atomic<bool> stop_{false};
  CoordinatorClient coordinator_;
  absl::Mutex mu_;
  std::unique_ptr<SpliceRelay> relay_ ABSL_GUARDED_BY(mu_);  // set once by Run()
  std::string advertise_;
  std::string id_ ABSL_GUARDED_BY(mu_);
  std::string id() {
    absl::MutexLock lock(&mu_);
    return id_;
  }
  std::unique_ptr<grpc::ClientContext> watch_context_ ABSL_GUARDED_BY(mu_);
  bool rejoin_needed_ = false;
};

}  // namespace geotrain

#endif  // GEOTRAIN_RELAY_RELAY_DAEMON_H_
