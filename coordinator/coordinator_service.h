// gRPC adapters for the Coordinator, Admin and Status services: they
// establish who the caller is, translate messages and statuses, and call
// the domain classes (JobController, AccessStore, ClusterAuthority).
//
// Who may call what (TLS mode; with `insecure` everyone may do everything
// and a worker is whoever a request's worker_id names):
// - Enroll: anyone holding a valid worker token (no certificate yet);
// - the other Coordinator calls: a worker, as itself: its id comes from its
//   client certificate, and a request naming another worker is refused;
// - Admin: the admin credential only;
// - Audit: a worker, as itself (what it may upload or fetch is the
//   AuditCoordinator's to say);
// - Status: any certificate of the cluster, or a viewer token
//   (metadata kTokenMetadataKey).
// Joins and enrollments are limited per source address (JoinRateLimiter).
// Sync API: the control plane is small unary calls plus one plan watch per worker.
#ifndef GEOTRAIN_COORDINATOR_COORDINATOR_SERVICE_H_
#define GEOTRAIN_COORDINATOR_COORDINATOR_SERVICE_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/access_store.h"
#include "coordinator/async_unary.h"
#include "coordinator/cluster_authority.h"
#include "coordinator/job_controller.h"
#include "coordinator/plan_streams.h"
#include "coordinator/reachability_prober.h"
#include "geotrain/v1/audit.grpc.pb.h"
#include "geotrain/v1/coordinator.grpc.pb.h"
#include "geotrain/v1/status.grpc.pb.h"

namespace geotrain {

// At most `per_minute` calls per source host in any minute (a sliding
// count over two half-minute buckets). Thread-safe.
class JoinRateLimiter {
 public:
  JoinRateLimiter(const Clock* clock, int per_minute) : clock_(clock), per_minute_(per_minute) {}
  // False when `source` is over its budget.
  bool Admit(const std::string& source);

 private:
  struct Window {
    int64_t bucket = 0;
    int current = 0, previous = 0;
  };
  const Clock* clock_;
  const int per_minute_;
  absl::Mutex mu_;
  std::map<std::string, Window> windows_ ABSL_GUARDED_BY(mu_);
};

// Calls of one kind in flight: at most `per_key` for one key (an identity,
// a source host) and `total` in all. Thread-safe.
class InFlightLimit {
 public:
  InFlightLimit(int per_key, int total) : per_key_(per_key), total_(total) {}
  // False (nothing held) when `key` or the whole is at its limit.
  bool Acquire(const std::string& key);
  void Release(const std::string& key);

 private:
  const int per_key_, total_;
  absl::Mutex mu_;
  std::map<std::string, int> held_ ABSL_GUARDED_BY(mu_);
  int all_ ABSL_GUARDED_BY(mu_) = 0;
};

struct CoordinatorServiceOptions {
  JobController* controller = nullptr;     // not owned, required
  const ClusterAuthority* authority = nullptr;  // not owned; null: insecure
  AccessStore* access = nullptr;           // not owned; null: insecure
  const Clock* clock = nullptr;            // not owned, required
  // Dials each joiner back (not owned); null: none is probed.
  const ReachabilityProber* prober = nullptr;
  // Joins per minute of one identity (TLS) or source host (insecure);
  // enrollments per minute with one token; refused enrollments per minute
  // from one source host (a stranger behind a NAT spends only its own
  // failures, never the volunteers' valid tokens).
  int joins_per_source_per_minute = 60;
  // Plan streams one identity may hold open, and all of them together
  // (each a few KiB; 8,192 left 1,800 of 10,000 workers without a plan,
  // retrying for ever).
  int watches_per_identity = 2;
  int max_watches = 32768;
  // Threads that serve Heartbeat, apart from the synchronous handlers.
  int heartbeat_threads = 2;
  // Calls without a client certificate (enrollments, status with a viewer
  // token) in flight, per source host and in all.
  int anonymous_calls_per_source = 4;
  int max_anonymous_calls = 32;
};

// Who is calling, as far as the transport tells (see the header comment).
class CallerCheck {
 public:
  explicit CallerCheck(const CoordinatorServiceOptions* options) : options_(options) {}
  bool insecure() const { return options_->access == nullptr; }
  // The worker the caller is. With TLS: the certificate's identity, which a
  // non-empty `claimed` id must equal; insecure: `claimed`.
  absl::StatusOr<std::string> Worker(const grpc::ServerContextBase& context,
                                     const std::string& claimed) const;
  absl::Status Admin(const grpc::ServerContextBase& context) const;
  absl::Status Viewer(const grpc::ServerContextBase& context) const;

 private:
  const CoordinatorServiceOptions* options_;
};

// WatchPlan runs on gRPC's asynchronous API (PlanStreams: one thread for
// every stream), and so does Heartbeat (threads of its own: a heartbeat
// never waits for a handler thread that joins or enrollments hold); the
// other methods are synchronous.
class CoordinatorService final
    : public v1::Coordinator::WithAsyncMethod_Heartbeat<
          v1::Coordinator::WithAsyncMethod_WatchPlan<v1::Coordinator::Service>> {
 public:
  explicit CoordinatorService(CoordinatorServiceOptions options);

  grpc::Status Enroll(grpc::ServerContext* context, const v1::EnrollRequest* request,
                      v1::EnrollResponse* response) override;
  grpc::Status Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override;
  grpc::Status Leave(grpc::ServerContext* context,
                     const v1::LeaveRequest* request,
                     v1::LeaveResponse* response) override;
  grpc::Status ReportStep(grpc::ServerContext* context,
                          const v1::StepReport* request,
                          v1::ReportAck* response) override;
  grpc::Status ReportEval(grpc::ServerContext* context,
                          const v1::EvalReport* request,
                          v1::ReportAck* response) override;
  grpc::Status ReportDone(grpc::ServerContext* context,
                          const v1::DoneReport* request,
                          v1::ReportAck* response) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext* context,
                              grpc::ServerReader<v1::LayerStateChunk>* reader,
                              v1::SaveCheckpointResponse* response) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext* context,
                              const v1::LoadCheckpointRequest* request,
                              grpc::ServerWriter<v1::LayerStateChunk>* writer) override;
  grpc::Status ReportEvent(grpc::ServerContext* context, const v1::WorkerEvent* request,
                           v1::ReportAck* response) override;

  // The asynchronous methods' queues (plan streams, heartbeats):
  // AttachAsyncMethods before the server is built, StartAsyncMethods after;
  // EndAsyncMethods (the plan streams end UNAVAILABLE: the coordinator is
  // going away) before the server's Shutdown, StopAsyncMethods after it.
  void AttachAsyncMethods(grpc::ServerBuilder* builder);
  void StartAsyncMethods();
  void EndAsyncMethods() { plan_streams_->Shutdown(); }
  void StopAsyncMethods();
  int open_plan_streams() const { return plan_streams_->open(); }

 private:
  grpc::Status HandleHeartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest& request,
                               v1::HeartbeatResponse* response);
  // RESOURCE_EXHAUSTED when `key` is over its budget in `limiter`.
  grpc::Status Admit(JoinRateLimiter& limiter, const std::string& key, const char* what);

  const CoordinatorServiceOptions options_;
  const CallerCheck caller_;
  JoinRateLimiter joins_;     // Join: per identity (TLS) or source host
  JoinRateLimiter enrolls_;   // Enroll: per token id
  JoinRateLimiter refusals_;  // refused Enrolls: per source host
  InFlightLimit watches_;
  InFlightLimit anonymous_;
  // Shared with the publisher's listener, which holds it weakly.
  std::shared_ptr<PlanStreams> plan_streams_;
  AsyncUnaryMethod<v1::HeartbeatRequest, v1::HeartbeatResponse> heartbeats_;
};

class AdminService final : public v1::Admin::Service {
 public:
  explicit AdminService(CoordinatorServiceOptions options)
      : options_(options), caller_(&options_) {}
  grpc::Status CreateToken(grpc::ServerContext* context, const v1::CreateTokenRequest* request,
                           v1::CreateTokenResponse* response) override;
  grpc::Status ListTokens(grpc::ServerContext* context, const v1::ListTokensRequest* request,
                          v1::ListTokensResponse* response) override;
  grpc::Status RevokeToken(grpc::ServerContext* context, const v1::RevokeTokenRequest* request,
                           v1::RevokeTokenResponse* response) override;
  grpc::Status RevokeWorker(grpc::ServerContext* context, const v1::RevokeWorkerRequest* request,
                            v1::RevokeWorkerResponse* response) override;
  grpc::Status ExportModel(grpc::ServerContext* context, const v1::ExportModelRequest* request,
                           grpc::ServerWriter<v1::ExportFileChunk>* writer) override;

 private:
  grpc::Status CheckAdmin(const grpc::ServerContext& context) const;
  const CoordinatorServiceOptions options_;
  const CallerCheck caller_;
};

// Spot checks (coordinator/audit_coordinator.h): workers only, each as
// itself.
class AuditService final : public v1::Audit::Service {
 public:
  explicit AuditService(CoordinatorServiceOptions options)
      : options_(options), caller_(&options_) {}
  grpc::Status UploadEvidence(grpc::ServerContext* context, const v1::AuditEvidence* request,
                              v1::ReportAck* response) override;
  grpc::Status FetchAudit(grpc::ServerContext* context, const v1::FetchAuditRequest* request,
                          v1::AuditBundle* response) override;
  grpc::Status ReportVerdict(grpc::ServerContext* context, const v1::AuditVerdict* request,
                             v1::ReportAck* response) override;

 private:
  const CoordinatorServiceOptions options_;
  const CallerCheck caller_;
};

class StatusService final : public v1::Status::Service {
 public:
  explicit StatusService(CoordinatorServiceOptions options)
      : options_(options),
        caller_(&options_),
        anonymous_(options.anonymous_calls_per_source, options.max_anonymous_calls) {}
  grpc::Status GetClusterStatus(grpc::ServerContext* context,
                                const v1::ClusterStatusRequest* request,
                                v1::ClusterStatus* response) override;

 private:
  const CoordinatorServiceOptions options_;
  const CallerCheck caller_;
  InFlightLimit anonymous_;  // status calls without a certificate
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_COORDINATOR_SERVICE_H_
