// Runs the pipeline schedule of one stage: decides what to compute next,
// calls StageRuntime, and moves messages between the inbox and the links.
//
// Every schedule is the same loop with three knobs (ScheduleConfig):
//   window W      stage 0 keeps at most W training microbatches in flight;
//   update_every  each stage applies an update after this many backwards;
//   flush         stage 0 starts step s+1 only when step s has fully returned.
// `sync` is (W = #stages, k = M, flush): one update per step, every
// microbatch of a step sees the same weights, so it matches one process.
// `async-stash` is (W, k, no flush) with weight stashing in StageRuntime;
// `async-2bw` is (min(W, M), M, no flush), which keeps at most two weight
// versions alive. Middle and last stages only react to what arrives; the
// window bounds every queue. Stage 0 evaluates every eval_every steps and
// at the end: it sends the pass's microbatches through the same window as
// training ones, each counted until the last stage acknowledges it
// (EVAL_ACK), so an async schedule evaluates without draining its
// pipeline (the microbatches in flight go on; new ones wait for the pass
// to be sent), and a flushed one (sync) at its step boundary, before the
// next step's updates, as one process would. A replicated stage 0 splits
// the microbatch ids among its workers (see
// PipelineDriverOptions::stage_replicas); only the primary evaluates. Torch-free; runs on one thread, except
// StatsBoard, which other threads read.
#ifndef GEOTRAIN_WORKER_PIPELINE_DRIVER_H_
#define GEOTRAIN_WORKER_PIPELINE_DRIVER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/adaptive_codec.h"
#include "common/link_rate_meter.h"
#include "common/plan_util.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"
#include "worker/audit_weights.h"
#include "worker/commitment_log.h"
#include "worker/message_sink.h"
#include "worker/output_norms.h"
#include "worker/outer_sync.h"
#include "worker/stage_replicas.h"
#include "worker/tied_gradient_exchange.h"
#include "worker/replica_router.h"
#include "worker/stage_runtime.h"

namespace geotrain {

// Where a stage reports progress (the coordinator, in production).
class ProgressSink {
 public:
  virtual ~ProgressSink() = default;
  // Called by the last stage after each step (1-based) of M microbatches.
  virtual void StepFinished(int step, double loss, int64_t samples) = 0;
  // Called by the last stage after an evaluation pass.
  virtual void EvalFinished(int step, const EvalResult& result) = 0;
  // Called by every stage after its step `step` (M backwards).
  virtual void StageProgress(int step) = 0;
  // Called by stage 0 (of several) after its step `step`: every microbatch
  // of it has come back from the last stage. The coordinator counts a step
  // once both ends have said so (coordinator/progress_gate.h).
  virtual void FirstStageFinished(int step) {}
  // Called every job.checkpoint_every steps with the stage's layers.
  virtual void CheckpointReady(std::vector<v1::LayerCheckpoint> layers) {}
  // Writes a stage's layers as chunks into `emit` (false: the stream broke).
  using LayerStateWriter =
      std::function<absl::Status(const std::function<bool(const v1::LayerStateChunk&)>& emit)>;
  // Instead of CheckpointReady for a stage over kLargestCheckpointSnapshot:
  // uploads `bytes` of state now, from the live tensors, while the driver
  // waits (a snapshot for a background upload would double the stage's
  // memory).
  virtual absl::Status UploadCheckpointNow(uint64_t bytes, const LayerStateWriter& write) {
    return absl::UnimplementedError("this sink takes no checkpoints");
  }
};

// A stage whose weights and optimizer state exceed this checkpoints
// between updates straight from its tensors (UploadCheckpointNow); smaller
// ones are copied and uploaded in the background.
inline constexpr uint64_t kLargestCheckpointSnapshot = uint64_t{256} << 20;

struct ScheduleConfig {
  int window = 1;
  int update_every = 1;
  bool flush = true;
  int max_weight_versions = 0;  // 0: unbounded
};

// The knobs for `job`'s schedule on a pipeline of `num_stages` (the async
// schedules' default window: pass the number of workers, replicas included).
// `planned_window`: the plan's in_flight (0: none); used when the job sets
// none, never below the number of stages nor above kMaxPlannedWindow.
ScheduleConfig ConfigureSchedule(const v1::JobSpec& job, int num_stages, int planned_window = 0);

// The latest StageStats of a stage, shared with the heartbeat thread, and
// the worker's compute threads (which outlive a stage).
class StatsBoard {
 public:
  void Set(const v1::StageStats& stats) {
    absl::MutexLock lock(&mu_);
    stats_ = stats;
  }
  void SetThreads(int threads, const std::string& reason) {
    absl::MutexLock lock(&mu_);
    threads_ = threads;
    threads_reason_ = reason;
  }
  // The downstream worker owed to answer and since when ("": none).
  void SetWaiting(const std::string& peer, absl::Time since) {
    absl::MutexLock lock(&mu_);
    waiting_on_ = peer;
    waiting_since_ = since;
  }
  v1::StageStats Get() const {
    absl::MutexLock lock(&mu_);
    v1::StageStats stats = stats_;
    stats.set_threads(threads_);
    stats.set_threads_reason(threads_reason_);
    if (!waiting_on_.empty()) {
      stats.set_waiting_on(waiting_on_);
      stats.set_waiting_s(absl::ToDoubleSeconds(absl::Now() - waiting_since_));
    }
    return stats;
  }

 private:
  mutable absl::Mutex mu_;
  v1::StageStats stats_ ABSL_GUARDED_BY(mu_);
  int threads_ ABSL_GUARDED_BY(mu_) = 0;
  std::string threads_reason_ ABSL_GUARDED_BY(mu_);
  std::string waiting_on_ ABSL_GUARDED_BY(mu_);
  absl::Time waiting_since_ ABSL_GUARDED_BY(mu_);
};

// A replica at the other end of an outer-sync link.
struct OuterPeer {
  int pipeline = 0;
  uint64_t link_epoch = 0;
};

struct PipelineDriverOptions {
  uint64_t epoch = 0;
  int stage = 0;
  int num_stages = 1;
  int start_step = 0;
  ScheduleConfig schedule;
  absl::Duration stats_window = absl::Seconds(10);
  std::string upstream_peer;    // for link statistics
  std::string downstream_peer;
  // The downstream worker's id when there is one (a routed stage asks its
  // router which replica holds the oldest microbatch).
  std::string downstream_worker;
  int64_t dropped_microbatches = 0;  // by this worker's earlier re-plans
  // Workers on the stage before: a later stage ends after a DONE from each.
  int upstream_workers = 1;
  // Replicas (this stage has several workers): each sees only some of the
  // microbatches, so its step is taken from the microbatches' ids (the
  // newest finished here), not from counting them; only the primary
  // uploads checkpoints; `averager` mixes the replicas' weights every
  // job.replica_sync_every steps. Not owned.
  bool replicated = false;
  bool primary = true;
  // Stage 0 with replicas: this worker is replica `replica_index` (0 for
  // the primary) of `stage_replicas`, and issues exactly the microbatch ids
  // i with i % stage_replicas == replica_index. A microbatch's data is a
  // function of (seed, id), so each replica's shard of the data is
  // deterministic and disjoint from the others'; together they cover every
  // id once. Each keeps ceil(window / stage_replicas) in flight, and only
  // the primary evaluates.
  int replica_index = 0;
  int stage_replicas = 1;
  StageReplicas* averager = nullptr;
  // Tied embeddings, where this stage holds one end: trades the tied
  // matrix's gradient with the other end at each update. Not owned.
  TiedGradientExchange* tied = nullptr;
  // This replica restored its stage from a checkpoint to join a running
  // stage: it adopts a sibling's weights before it averages (see
  // ReplicaAverager).
  bool catching_up = false;
  // The downstream router, for its statistics (may be null). Not owned.
  const ReplicaRouter* router = nullptr;
  // The codecs of this stage's outgoing activations and gradients (the
  // plan's for each link; UNSPECIFIED: the job's). With adaptive
  // compression, each link's strongest.
  v1::Codec activation_codec = v1::CODEC_UNSPECIFIED;
  v1::Codec gradient_codec = v1::CODEC_UNSPECIFIED;
  // With microbatches of this stage still downstream, how long the stage
  // waits for any message before it takes the downstream link as stalled
  // (a neighbour that holds its stream open and sends nothing back): the
  // run ends UNAVAILABLE on that link, naming the peer, as if it broke.
  // ReplyTimeoutFor scales it so the stage next to a stall notices first.
  absl::Duration reply_timeout = absl::InfiniteDuration();
  // Several pipelines (job.outer): the outer sync of this stage's replicas.
  // The driver ends its rounds after the updates that end them, feeds it
  // the messages of the replica links, keeps its deadlines and, while a
  // mean is owed (OuterSync::MustWait), takes only those messages (the
  // others wait their turn). Not owned; null without one.
  OuterSync* outer = nullptr;
  // How long a stage waits for an owed mean before it takes the link to
  // the reducer as stalled, beyond what the reducer's transfers take at the
  // outer pace (OuterSync::WaitAllowance).
  absl::Duration outer_timeout = absl::Minutes(2);
  // The replicas at the other ends of the outer-sync links, by worker id:
  // each one's pipeline and its link's epoch (a message or error of an
  // older link to the same worker is that link's last words: ignored).
  // Not owned; read on the driver's thread, changed only by `poll`. The
  // reducer is the one of pipeline 0 (blamed for a mean that never comes).
  const std::map<std::string, OuterPeer>* outer_peers = nullptr;
  // Called on the driver's thread between messages and steps, at least
  // every second while it waits: where a session that goes on through a
  // re-plan changes the outer sync's replicas (TrainingSession::Amend). An
  // error ends the run. May be empty.
  std::function<absl::Status()> poll;
  // Logs the training messages this stage receives and sends, with their
  // commitments (the evidence spot checks use). Not owned; null: none.
  CommitmentLog* commitments = nullptr;
  // Spot checks: each weight version this stage computes training
  // forwards with is kept here (weights only) before its first forward, so
  // an audit after the step can name it. Not owned; null or not enabled:
  // none.
  AuditWeights* audit_weights = nullptr;
  // Told when an outer-sync link broke, a replica's message was refused, or
  // a mean never came: the sync goes on without that replica (its
  // pipeline, or this one when it was the reducer, is the coordinator's to
  // re-plan); this pipeline keeps training. May be empty.
  std::function<void(const std::string& peer, uint64_t link_epoch, const std::string& why)>
      on_replica_lost;
};

// A stage's reply timeout: `base` times the stages between it and the last
// stage, so that of the stages waiting on one stalled downstream worker the
// nearest one's timer ends first (and its report re-plans the others).
absl::Duration ReplyTimeoutFor(absl::Duration base, int stage, int num_stages);

class PipelineDriver {
 public:
  // `upstream`/`downstream` may be null on the first/last stage; `stats`
  // may be null. None owned; all must outlive Run().
  PipelineDriver(const v1::JobSpec& job, const PipelineDriverOptions& options,
                 StageRuntime* runtime, MessageSink* upstream,
                 MessageSink* downstream, Inbox* inbox, ProgressSink* progress,
                 StatsBoard* stats = nullptr);

  // Trains until the job's last step (stage 0) or until DONE arrives.
  // Returns an error when a link breaks or computing fails.
  absl::Status Run();

  // After Run() failed: which link broke, if one did, and the worker at its
  // other end when known.
  enum class FailedLink { kNone, kUpstream, kDownstream, kReplica };
  FailedLink failed_link() const { return failed_link_; }
  const std::string& failed_peer() const { return failed_peer_; }

 private:
  absl::Status RunFirstStage();
  // Stage 0: the first id at or after `id` in this replica's shard.
  int64_t OwnIdFrom(int64_t id) const;
  absl::Status RunLaterStage();
  // A single-stage pipeline evaluates in one go.
  absl::Status RunEvaluation(int step);
  // Stage 0 of several: sends the pass's next evaluation microbatch, or
  // after the last its EVAL_END (then the pass is over).
  absl::Status SendNextEvalMicrobatch();
  // Bookkeeping after one microbatch's backward on this stage: updates,
  // step boundaries, evaluation (stage 0), reports and statistics.
  // `microbatch`: its global id (step * M + index).
  absl::Status AfterBackward(double loss, uint64_t microbatch);
  // Step boundaries passed: progress reports, checkpoints, replica pushes.
  absl::Status AtStep(int step);
  // Replicas: mixes in the weights the other replicas pushed.
  void AverageReceivedWeights();
  absl::StatusOr<InboundMessage> NextMessage();
  // The next message from the inbox, or one set aside while a mean was
  // owed; outer-sync messages are handled here and never returned.
  std::optional<InboundMessage> PopMessage(absl::Duration timeout);
  // Hands a replica link's message to the outer sync; a broken link or a
  // refused message detaches that replica (LoseReplica).
  absl::Status HandleOuter(InboundMessage in);
  absl::Status LoseReplica(const std::string& peer, const std::string& why);
  // The outer-sync replica `peer` (null: none now), and the reducer's id
  // ("" for the reducer itself, or while it has none).
  const OuterPeer* OuterPeerOf(const std::string& peer) const;
  std::string OuterReducer() const;
  // Waits while the outer sync owes this stage a mean.
  absl::Status AwaitOuterMean();
  // What the runtime refused of a received message (INVALID_ARGUMENT: its
  // tensors do not decode, or are not finite) is the sender's fault: the
  // run ends as the link it came on failing, naming the sender, so a bad
  // message costs the sender its link and the coordinator re-plans around
  // it. Other errors (and OK) pass through.
  absl::Status RefusedFrom(const InboundMessage& in, absl::Status status);
  // Keeps the current weight version for audits if it is new (see
  // PipelineDriverOptions::audit_weights). A failure is logged, not
  // fatal: training never waits on the spot checks.
  void KeepWeightsForAudit();
  // Commits `message`, this stage's own output, to the digest of the
  // weights it was computed with (LinkHeader.weights_digest) when they are
  // the version KeepWeightsForAudit kept last, as they are right after it.
  void StampWeightsDigest(LinkMessage* message) const;
  absl::Status SendDown(LinkMessage message);
  absl::Status SendUp(LinkMessage message);
  void PublishStats();

  const v1::JobSpec job_;
  const PipelineDriverOptions options_;
  StageRuntime* runtime_;
  MessageSink* upstream_;
  MessageSink* downstream_;
  Inbox* inbox_;
  ProgressSink* progress_;
  StatsBoard* stats_;

  FailedLink failed_link_ = FailedLink::kNone;
  std::string failed_peer_;
  int64_t backwards_ = 0;               // microbatches finished on this stage
  // Activations (training and evaluation) sent down and not yet answered
  // (a gradient or an EVAL_ACK came back): while any are, the downstream
  // owes this stage a message (reply_timeout).
  int64_t pending_down_ = 0;
  // The longest wait for a message from downstream while one was owed.
  absl::Duration longest_owed_wait_;
  // Position in the run in microbatches: backwards_, or for a replica one
  // past the newest microbatch id it finished.
  int64_t position_ = 0;
  int64_t weight_averages_ = 0;
  bool catching_up_ = false;
  int checkpoint_due_ = 0;              // step of a checkpoint not yet taken
  int dones_ = 0;                       // DONE messages received
  std::set<std::string> done_from_;     // ... from these upstream workers
  int64_t done_end_ = 0;  // a replica: the largest end of its ids a DONE named
  int backwards_since_update_ = 0;
  int eval_due_ = 0;                    // stage 0: step to evaluate at, or 0
  // Messages that came while a mean was owed, in order.
  std::deque<InboundMessage> set_aside_;
  absl::Status outer_failure_;          // from HandleOuter inside PopMessage
  int64_t samples_since_round_ = 0;     // trained since the last outer round ended
  uint64_t outer_bytes_received_ = 0;
  // Stage 0: the evaluation pass being sent (its step, 0: none) and its
  // next microbatch. Its microbatches count in the window until the last
  // stage acknowledges them (EVAL_ACK).
  int64_t audit_kept_version_ = -1;     // the version KeepWeightsForAudit kept last
  std::string audit_kept_digest_;       // and its digest,
  std::string audit_kept_state_digest_;  // its optimizer state's (update-audited stages)
  int64_t audit_kept_weight_syncs_ = 0;  // and the stage's weight syncs then
  int eval_pass_ = 0;
  int eval_next_ = 0;
  double step_loss_sum_ = 0;            // last stage: losses of this step
  int step_losses_ = 0;

  // Statistics: cumulative idle time, and samples (time, idle, backwards)
  // for figures over a recent window.
  absl::Time start_;
  absl::Duration idle_;
  struct Sample {
    absl::Time time;
    absl::Duration idle;
    absl::Duration send;
    int64_t backwards;
  };
  std::deque<Sample> samples_;
  absl::Time last_published_ = absl::InfinitePast();
  // One neighbour link as this stage sees it: what it sent and received,
  // how fast what it sends arrives (measured by the peer), and, with
  // `adaptive`, the codec it sends with.
  struct LinkState {
    uint64_t bytes = 0, raw_bytes = 0, messages = 0;
    absl::Duration send_time;
    std::string codec;
    uint64_t bytes_received = 0, raw_bytes_received = 0;
    LinkRateMeter receive_meter;
    double peer_rate_bps = 0;
    double wire_bytes_per_message = 0;  // recent training messages sent
    std::optional<AdaptiveCodecSelector> selector;
    int messages_since_observation = 0;
    // The size of what the peer sent: the receiver's cheap check.
    OutputNormMeter received_norms;
  };
  LinkState down_link_, up_link_;
  absl::Duration send_total_;  // time in Send(), all links
  absl::Status CountedSend(MessageSink* sink, LinkMessage message, LinkState* link);
  void CountReceived(const InboundMessage& in);
  // Pure compute per microbatch over the recent window (no idle, no sends).
  double RecentComputeSeconds() const;
  void ObserveLink(LinkState* link, bool activations);
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_PIPELINE_DRIVER_H_
