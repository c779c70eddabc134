// The worker's side of the Coordinator service: join with backoff,
// heartbeats, the plan watch, and progress reports. Every unary call has a
// deadline (rpc_options.h). Thread-safe once joined.
#ifndef GEOTRAIN_WORKER_COORDINATOR_CLIENT_H_
#define GEOTRAIN_WORKER_COORDINATOR_CLIENT_H_

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "geotrain/v1/coordinator.grpc.pb.h"
#include "common/clock.h"
#include "common/transport_security.h"
#include "worker/checkpoint_pacer.h"
#include "geotrain/v1/audit.grpc.pb.h"
#include "worker/peer_prober.h"
#include "worker/pipeline_driver.h"
#include "worker/report_queue.h"
#include "worker/session_parts.h"

namespace geotrain {

// Reads layers' state (runs of LayerStateChunks, checked) from `reader` and
// finishes the call: the coordinator's restores and a peer's
// (StageState.FetchLayerState) alike.
absl::StatusOr<std::vector<v1::LayerCheckpoint>> ReceiveLayerStates(
    grpc::ClientReader<v1::LayerStateChunk>& reader, uint64_t max_layer_bytes);

class CoordinatorClient final : public SessionCoordinator {
 public:
  // `pacing`: how background checkpoint uploads share the uplink.
  explicit CoordinatorClient(std::string address, CheckpointPacingOptions pacing = {});
  // TLS towards the coordinator (whose certificate must name
  // `server_name`). REQUIRES: called before any other method.
  void UseSecurity(const TransportSecurity& security, const std::string& server_name);

  // Joins, retrying with exponential backoff (0.5 s doubling to 10 s) and
  // logging the address it cannot reach, until it succeeds, `stop` is set,
  // or `give_up_after` passes (infinite by default).
  absl::StatusOr<v1::JoinResponse> JoinWithRetry(
      const v1::JoinRequest& request, const std::atomic<bool>& stop,
      absl::Duration give_up_after = absl::InfiniteDuration());

  // Sets the plan epoch that reports carry. The worker id is set by each
  // (re)join.
  void SetEpoch(uint64_t epoch) override;
  std::string worker_id() const;

  // Carries the results of `prober` (when set) and hands it the probes the
  // coordinator asks for.
  absl::StatusOr<bool> Heartbeat(uint64_t rss_bytes, const v1::StageStats& stats);
  // REQUIRES: before the first Heartbeat; `prober` outlives this client.
  void UsePeerProber(PeerProber* prober) { prober_ = prober; }
  // Called with each heartbeat reply that asks for spot-check work
  // (evidence, audits to verify), on the heartbeat thread: it must only
  // queue the work. REQUIRES: before the first Heartbeat.
  void OnAuditWork(std::function<void(const v1::HeartbeatResponse&)> handler) {
    audit_work_ = std::move(handler);
  }
  // The spot checks' calls (geotrain/v1/audit.proto), on the checkpoints'
  // connection, each with `timeout`.
  absl::Status UploadAuditEvidence(const v1::AuditEvidence& evidence, absl::Duration timeout);
  absl::StatusOr<v1::AuditBundle> FetchAudit(uint64_t audit_id, absl::Duration timeout);
  absl::Status ReportAuditVerdict(const v1::AuditVerdict& verdict, absl::Duration timeout);
  // Every later heartbeat carries these (worker/layer_benchmark.h).
  void SetLayerTimings(std::map<std::string, double> seconds_per_sample);
  // Opens the plan stream. `context` must outlive the reader.
  std::unique_ptr<grpc::ClientReader<v1::Plan>> WatchPlan(grpc::ClientContext* context);
  absl::Status ReportDone(int step) override;
  // A heartbeat with this process's memory and `stats`.
  void ReportFinalStats(const v1::StageStats& stats) override;
  void Leave();

  // Stage checkpoints: SaveCheckpoint uploads now (deadline: 30 s plus the
  // time at the pace); CheckpointReady (from the pipeline driver) hands them
  // to a background uploader that keeps only the newest pending one, so a
  // slow coordinator never stalls training, and paces it (CheckpointPacer,
  // following the links each heartbeat reports), so an upload never takes
  // the bandwidth of the pipeline's links. UploadCheckpointNow is not
  // paced: the pipeline waits for it (between updates, or a drain).
  // LoadCheckpoint: NOT_FOUND when there is none.
  absl::Status SaveCheckpoint(std::vector<v1::LayerCheckpoint> layers);
  // `probe`: only to compare steps (the coordinator records no restore).
  // The layer arrives in chunks (common/layer_state.h); one declaring more
  // than `max_layer_bytes` is refused before anything is allocated.
  // `step`: that step's checkpoint, not the newest (a rollback's restore).
  absl::StatusOr<v1::LayerCheckpoint> LoadCheckpoint(int layer, bool probe = false,
                                                     uint64_t max_layer_bytes = 1 << 30,
                                                     std::optional<int> step = std::nullopt);
  void CheckpointReady(std::vector<v1::LayerCheckpoint> layers) override;
  // The uploads' pacer, which also knows the uplink as measured.
  const CheckpointPacer& pacer() const { return pacer_; }
  absl::Status UploadCheckpointNow(uint64_t bytes, const LayerStateWriter& write) override;
  // Logged and dropped on failure.
  // Carries the epoch set by SetEpoch().
  void ReportEvent(const std::string& kind, const std::string& detail,
                   const std::string& peer = "") override;
  void ReportEventOfEpoch(uint64_t epoch, const std::string& kind, const std::string& detail,
                          const std::string& peer) override;
  ~CoordinatorClient() override;

  // ProgressSink: reports go to the coordinator from a background queue
  // (ReportQueue), in order, so the driver never waits on it; failures are
  // logged. ReportDone() sends what is pending first.
  void StepFinished(int step, double loss, int64_t samples) override;
  void EvalFinished(int step, const EvalResult& result) override;
  void StageProgress(int step) override { step_ = step; }
  void FirstStageFinished(int step) override;
  int stage_step() const { return step_; }

  const std::string& address() const { return address_; }

 private:
  void UploadLoop();
  // Waits for the pace to allow `bytes`; false if the uploader is stopping.
  bool AwaitPace(uint64_t bytes);

  const std::string address_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  // Checkpoints, on a connection of their own (rpc_options.h: Connection).
  std::unique_ptr<v1::Coordinator::Stub> bulk_stub_;
  std::unique_ptr<v1::Audit::Stub> audit_stub_;  // on bulk_stub_'s connection
  std::function<void(const v1::HeartbeatResponse&)> audit_work_;
  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  std::optional<std::vector<v1::LayerCheckpoint>> pending_upload_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, double> layer_timings_ ABSL_GUARDED_BY(mu_);
  bool uploader_stop_ ABSL_GUARDED_BY(mu_) = false;
  bool uploading_ ABSL_GUARDED_BY(mu_) = false;  // an upload is on its way
  std::thread uploader_;
  PeerProber* prober_ = nullptr;
  SteadyClock clock_;
  CheckpointPacer pacer_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> step_{0};
  static constexpr absl::Duration kFlushBeforeDone = absl::Seconds(10);
  // How long a step report the coordinator cannot take yet is retried.
  static constexpr absl::Duration kRetryReportsFor = absl::Seconds(30);
  // Last: destroyed (flushed) first, while the stub its sends use lives.
  ReportQueue reports_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_COORDINATOR_CLIENT_H_
