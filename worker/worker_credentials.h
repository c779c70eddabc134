// How a worker proves who it is: its certificate from the coordinator's CA.
//
// First join: the token names the coordinator's CA by fingerprint; the
// worker fetches the chain the coordinator serves, keeps the CA with that
// fingerprint (PinCertificateAuthority), generates a P-256 key and trades
// a CSR and the token for a certificate whose common name is its worker id
// (Coordinator.Enroll). With a --state_dir the key, certificate and CAs are
// kept there (the key mode 0600), and a later start rejoins as the same
// worker without a token. Thread-compatible.
#ifndef GEOTRAIN_WORKER_WORKER_CREDENTIALS_H_
#define GEOTRAIN_WORKER_WORKER_CREDENTIALS_H_

#include <atomic>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport_security.h"

namespace geotrain {

struct WorkerCredentialOptions {
  std::string coordinator;  // HOST:PORT
  std::string token;        // needed unless state_dir holds a credential
  std::string state_dir;    // empty: nothing kept on disk
  std::string name;         // shown in status
  // The name the coordinator's certificate must carry.
  std::string coordinator_server_name = kCoordinatorServerName;
  absl::Duration rpc_timeout = absl::Seconds(10);
};

struct WorkerCredentials {
  std::string worker_id;
  TransportSecurity coordinator;  // trusts the coordinator's serving CA
  TransportSecurity peers;        // trusts the cluster CA (other workers)
  bool enrolled_now = false;      // false: loaded from state_dir
};

// Loads the credential kept in `state_dir` or enrolls with the token,
// retrying while the coordinator is unreachable until `give_up_after`
// passes or `stop` is set. A refused token is returned at once
// (UNAUTHENTICATED / PERMISSION_DENIED, saying why).
absl::StatusOr<WorkerCredentials> ObtainWorkerCredentials(const WorkerCredentialOptions& options,
                                                          const std::atomic<bool>& stop,
                                                          absl::Duration give_up_after);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_WORKER_CREDENTIALS_H_
