// The worker daemon's composition root: serves the Stage service, joins the
// coordinator, heartbeats, watches the plan, builds its stage, opens links
// and runs the pipeline driver until the job ends.
//
// Plans change while it runs: a new plan epoch aborts the pipeline of the
// old one (its microbatches in flight are dropped and counted) and the
// worker takes its place in the new plan: with the same stage it keeps its
// runtime (weights, optimizer state), with a new one it builds the stage
// and restores its layers from the coordinator's latest checkpoints; with
// none it is a standby. A worker the coordinator no longer knows (its lease
// ran out, e.g. after SIGSTOP) joins again as a new standby. Drain()
// (SIGTERM) hands the stage over: checkpoint now, then leave.
//
// A stage other than the last may have several workers (replicas): the
// stage before routes microbatches among them (ReplicaRouter), or on stage
// 0 each issues its own share of the microbatch ids; the stage
// after returns each gradient to the one that sent its activation
// (UpstreamLinks), and they average weights (ReplicaAverager). Only a
// stage's primary uploads checkpoints.
//
// Links: the plan says which end of each link dials (PlannedLink): this
// worker dials its downstream neighbours that are reachable, waits for the
// unreachable ones to dial it, dials upstream neighbours that cannot be
// dialled, and meets the others at a relay.
//
// Threads: Run()'s caller (plan handling, then the driver), a heartbeat
// thread, a plan-watch thread, gRPC's server threads, one reader per link
// this worker opened and the averager's sender.
#ifndef GEOTRAIN_WORKER_WORKER_H_
#define GEOTRAIN_WORKER_WORKER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/health_reporter.h"
#include "common/metrics_exporter.h"
#include "geotrain/v1/coordinator.pb.h"
#include "worker/audit_responder.h"
#include "worker/audit_weights.h"
#include "worker/coordinator_client.h"
#include "worker/link_service.h"
#include "worker/pipeline_driver.h"
#include "worker/replica_averager.h"
#include "worker/send_pacer.h"
#include "worker/tied_gradient_exchange.h"
#include "worker/training_session.h"
#include "worker/worker_links.h"
#include "worker/stage_state_server.h"
#include "worker/stage_runtime.h"
#include "worker/worker_credentials.h"

namespace geotrain {

struct WorkerOptions {
  std::string coordinator = "127.0.0.1:7070";
  std::string listen = "0.0.0.0:0";
  std::string advertise;  // HOST[:PORT] peers dial; default: from listen
  std::string device = "auto";
  int threads = 0;
  std::string name;
  // Peer address (as the plan names it) -> address to dial instead, e.g. a
  // geotrain-linkem relay in front of that peer.
  std::map<std::string, std::string> routes;
  absl::Duration join_timeout = absl::InfiniteDuration();
  // Plaintext, no identities: for a coordinator started with --insecure.
  bool insecure = false;
  std::string token;      // join token (first join; see worker_credentials.h)
  std::string state_dir;  // keeps this worker's key and certificate; empty: none
  std::string tls_server_name = kCoordinatorServerName;
  // How background checkpoint uploads share the uplink with the links.
  CheckpointPacingOptions checkpoint_pacing;
  // HOST:PORT serving only the gRPC health service (and reflection) in
  // plaintext, for probes without TLS; empty: none.
  std::string health_listen;
  // HOST:PORT serving Prometheus /metrics (plain HTTP, no credentials);
  // empty: none.
  std::string metrics_listen;
  // Fault injection, for tests only (geotrain-worker never sets it): wraps
  // the sink the pipeline sends through toward each neighbouring stage
  // (`toward`: kUpstream for gradients, kDownstream for activations), for
  // each plan. The wrapper must outlive nothing but the plan's run; `real`
  // stays valid that long. tests/integration/misbehaving_worker_main.cc
  // plays a hostile volunteer with it.
  std::function<std::unique_ptr<MessageSink>(PeerSide toward, MessageSink* real)> wrap_link;
  // For tests only, with wrap_link: the commitment log to keep instead of
  // the worker's own (not owned; must outlive the worker), so that a
  // hostile wrapper can log what it really sent, as a liar in control of
  // its own code would, and face the spot checks' recomputation rather
  // than a dispute between logs.
  CommitmentLog* commitment_log = nullptr;
  // For tests only: changes each spot-check verdict this worker reports as
  // a verifier (a verifier that lies; the coordinator must outvote it).
  std::function<void(v1::AuditVerdict*)> tamper_verdict;
  // For tests only: changes the options of each stage runtime this worker
  // builds (RuntimeOptions::tamper_skip_layer: a stage that leaves a layer
  // out). Its spot-check verifiers' runtimes are not changed.
  std::function<void(RuntimeOptions*)> tamper_runtime;
};

// Parses "PEER=VIA[,PEER=VIA...]" (each a HOST:PORT) into WorkerOptions::routes.
absl::StatusOr<std::map<std::string, std::string>> ParseLinkRoutes(const std::string& spec);

class Worker {
 public:
  explicit Worker(WorkerOptions options);
  ~Worker();

  // Runs until the job ends (OK), Stop() is called (CANCELLED), or a
  // failure that this worker cannot recover from.
  absl::Status Run();
  // Thread-safe; may be called from a signal-handling thread.
  void Stop();
  // Stops after saving this worker's stage to the coordinator and leaving,
  // so that a standby takes over without losing its updates. Thread-safe.
  void Drain();

 private:
  absl::Status StartServer();
  void HeartbeatLoop(int interval_ms);
  void WatchLoop();
  absl::Status JoinCoordinator();
  // Waits for a plan newer than `after_epoch` that gives this worker a
  // stage; nullopt if the job ended, Stop() was called or a re-join is due.
  std::optional<v1::Plan> WaitForAssignment(uint64_t after_epoch);
  // Trains the stage the plan gives this worker, in a TrainingSession.
  absl::Status Train(const v1::Plan& plan);
  // A runtime for `placement`: the current one if it fits (after dropping
  // what is in flight) and the job has not rolled back since it was made
  // (`rollback_epoch`, Plan.rollback_epoch), else a new one restored from
  // checkpoints: those of `rollback_step` in the plan that rolls back.
  // True when it built a new one.
  absl::StatusOr<bool> PrepareRuntime(const StagePlacement& placement,
                                      const ScheduleConfig& schedule,
                                      const v1::StageAssignment& mine, uint64_t epoch,
                                      uint64_t rollback_epoch, int rollback_step);
  // The plan sends newcomers of this worker's stage here for its state
  // (state_source): offer them a snapshot taken now.
  void OfferStateToNewcomers(const v1::StageAssignment& mine, uint64_t epoch);
  // The stage's state from the live holder the plan names.
  absl::StatusOr<std::vector<v1::LayerCheckpoint>> FetchFromHolder(
      const v1::StageAssignment& mine, uint64_t epoch);
  absl::Status HandOver();
  // Ends the current session: the driver returns, links close.
  void AbortTrainingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorkerOptions options_;
  std::atomic<bool> stop_{false};
  PeerProber prober_;  // before coordinator_, which uses it
  CoordinatorClient coordinator_;
  LinkOptions link_options_;  // set by Run() before anything dials or serves
  std::unique_ptr<LinkService> link_service_;  // made by StartServer()
  std::unique_ptr<WorkerLinks> links_;         // over link_service_
  ReplicaAverager averager_;
  TiedGradientExchange tied_;  // llama.tie_embeddings: the first and last stage's exchange
  StageStateServer state_server_;
  // The outer sync's share of the measured uplink (kOuterUplinkShare).
  SteadyClock clock_;
  std::shared_ptr<UplinkSharePacer> outer_pacer_;
  // What this worker's pipeline links carried, across its sessions.
  CommitmentLog own_commitments_;
  CommitmentLog& commitments_;  // own_commitments_ or options_.commitment_log
  // Spot checks (a job with verification.fraction): the weight versions
  // kept for audits, and the thread that answers the coordinator's audit
  // work. Declared after coordinator_, whose calls the responder makes.
  AuditWeights audit_weights_;
  std::unique_ptr<AuditResponder> audit_responder_;
  TransportSecurity peer_security_ = TransportSecurity::Insecure();
  // SERVING while this worker trains a stage with its links open;
  // NOT_SERVING before a plan, as a standby, and between plans.
  HealthReporter health_{"geotrain.v1.Stage", "no plan yet"};
  std::atomic<int> current_stage_{-1};  // while training; for the metrics' labels
  std::unique_ptr<MetricsExporter> metrics_;  // with options_.metrics_listen
  // This worker's /metrics: its health, and its stage's and links' figures.
  MetricsSnapshot Metrics() const;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;  // with options_.health_listen
  std::string advertise_;
  std::string device_name_;  // resolved, e.g. "cpu" or "cuda:0"
  std::string worker_id_;
  v1::JobSpec job_;
  int heartbeat_ms_ = 1000;
  StatsBoard stats_;
  std::unique_ptr<StageRuntime> runtime_;  // Run()'s thread only
  // The newest rollback (Plan.rollback_epoch) runtime_'s state postdates.
  uint64_t runtime_rollback_epoch_ = 0;    // Run()'s thread only
  int64_t dropped_microbatches_ = 0;       // Run()'s thread only
  bool primary_ = true;                    // Run()'s thread only: not a replica
  bool was_standby_ = false;               // Run()'s thread only: since the last Train
  std::atomic<bool> drain_{false};
  // Set when the coordinator refuses this worker for good (revoked).
  absl::Mutex fatal_mu_;
  absl::Status fatal_ ABSL_GUARDED_BY(fatal_mu_);

  std::thread heartbeat_thread_;
  std::thread watch_thread_;
  // Times the job's layer kinds (worker/layer_benchmark.h) and hands the
  // figures to the heartbeats. On the compute thread only.
  void MeasureLayerKinds();
  // With a job that runs spot checks: keeps evidence and answers audits
  // (once; the job does not change between joins).
  void StartAuditResponder();
  // What the layer timings may take in all (the quick models take far less).
  static constexpr absl::Duration kLayerTimingBudget = absl::Milliseconds(300);
  absl::Mutex mu_;
  std::unique_ptr<grpc::ClientContext> watch_context_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::Plan> latest_plan_ ABSL_GUARDED_BY(mu_);
  // The session training a stage now; null between plans.
  std::shared_ptr<TrainingSession> session_ ABSL_GUARDED_BY(mu_);
  // The newest plan epoch the current (or last) session served.
  std::atomic<uint64_t> served_plan_epoch_{0};
  bool rejoin_needed_ ABSL_GUARDED_BY(mu_) = false;
  bool watch_ended_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_WORKER_H_
