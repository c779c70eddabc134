// A daemon's health, published through gRPC's standard health service
// (grpc.health.v1.Health; gRPC's default implementation serves Check and
// Watch): SERVING or NOT_SERVING, for the whole server ("") and for the
// daemon's own service name alike. Each change is logged with its reason,
// which the protocol itself does not carry.
//
// Besides "" and the daemon's service, the service name "liveness" is
// SERVING for as long as the process runs (until ShutDown): a liveness
// probe asks for it, a readiness probe for "".
//
// The health service answers without credentials (it says nothing but the
// status); every other service keeps its own checks. A daemon may also
// serve it on a plaintext port of its own (--health_listen), for probes
// that speak no TLS (Kubernetes' grpc probes).
#ifndef GEOTRAIN_COMMON_HEALTH_REPORTER_H_
#define GEOTRAIN_COMMON_HEALTH_REPORTER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace geotrain {

// Turns on gRPC's health service and server reflection for every server
// built afterwards. Call before constructing the daemon's ServerBuilder.
void EnableStandardServices();

inline constexpr char kLivenessService[] = "liveness";

// A plaintext server on `listen` with only the health service and
// reflection (EnableStandardServices() first); UNAVAILABLE if it cannot
// listen there.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const std::string& listen);

// Thread-safe.
class HealthReporter {
 public:
  // `service`: the daemon's main service, e.g. "geotrain.v1.Coordinator".
  // Starts NOT_SERVING, for the reason `why`.
  HealthReporter(std::string service, std::string why);

  // Publishes through `server`'s health service too from now on, the
  // current status at once (gRPC's service starts at SERVING, so call this
  // right after BuildAndStart).
  void Attach(grpc::Server* server);
  // Stops publishing to any server (before they are destroyed).
  void DetachAll();
  // Changes the status; logs `why` when the status changes.
  void Set(bool serving, absl::string_view why);
  // NOT_SERVING for good (a server shutting down).
  void ShutDown(absl::string_view why);

  bool serving() const;
  std::string why() const;

 private:
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string service_;
  mutable absl::Mutex mu_;
  std::vector<grpc::Server*> servers_ ABSL_GUARDED_BY(mu_);
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::string why_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_HEALTH_REPORTER_H_
