// One worker's session in one plan epoch: it opens the stage's links as
// the plan says, runs the pipeline driver on the runtime it is given, and
// ends with DONE reported or with the first failure (a lost link is
// reported to the coordinator, naming the neighbour, or the relay).
//
// It is built from parts behind small interfaces, so that a test drives a
// whole session with fakes (tests/worker/training_session_test.cc):
//   - the plan it serves (ServedPlan, pure data);
//   - the links it opens and the service that answers its neighbours
//     (SessionLinks; the real one is WorkerLinks);
//   - the stage's runtime (StageRuntime, prepared by the caller);
//   - the stage's replicas (StageReplicas; the real one is ReplicaAverager);
//   - with several pipelines, the outer sync (OuterSync) over replica links
//     this session opens like its neighbours' (SessionLinks);
//   - the coordinator calls (SessionCoordinator; CoordinatorClient).
// The Worker owns the parts, prepares the runtime, and ends a session from
// its plan-watch or heartbeat thread with Abort().
//
// Threading: Run() on the worker's compute thread; Abort() from any
// thread, any time, also before Run() starts. The session outlives Run().
#ifndef GEOTRAIN_WORKER_TRAINING_SESSION_H_
#define GEOTRAIN_WORKER_TRAINING_SESSION_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "geotrain/v1/job.pb.h"
#include "worker/message_sink.h"
#include "worker/outer_links.h"
#include "worker/outer_sync.h"
#include "worker/pipeline_driver.h"
#include "worker/replica_router.h"
#include "worker/served_plan.h"
#include "worker/session_parts.h"
#include "worker/stage_replicas.h"
#include "worker/stage_runtime.h"
#include "worker/tied_gradient_exchange.h"

namespace geotrain {

struct SessionOptions {
  // Where replicas push to: peer address (as the plan names it) -> address
  // to dial instead.
  std::map<std::string, std::string> routes;
  // DONE may meet a coordinator that is restarting: it is retried this
  // often, this many times.
  absl::Duration done_retry_interval = absl::Seconds(1);
  int done_attempts = 30;
  // Microbatches this worker dropped in earlier plans (for the statistics).
  int64_t dropped_microbatches = 0;
  // The inbox's bound: messages read from the links and not yet handled.
  size_t inbox_capacity = 64;
  // Fault injection for tests (WorkerOptions::wrap_link).
  std::function<std::unique_ptr<MessageSink>(PeerSide toward, MessageSink* real)> wrap_link;
  // Told when the stage starts training with its links open, and when it
  // stops (the worker's gRPC health follows it). May be empty.
  std::function<void(bool serving, const std::string& why)> on_serving;
  // Told on the compute thread once the session goes on in a new plan
  // (Amend): the worker offers the stage's state to the plan's newcomers.
  // May be empty.
  std::function<void(const ServedPlan& plan)> on_amended;
};

struct SessionParts {
  SessionCoordinator* coordinator = nullptr;  // required
  SessionLinks* links = nullptr;              // required
  StageReplicas* replicas = nullptr;          // required when the stage is replicated
  TiedGradientExchange* tied = nullptr;       // required for tied embeddings
  StatsBoard* stats = nullptr;                // required
  // Paces the outer sync's links (null: unpaced).
  std::shared_ptr<SendPacer> outer_pacer;
  // Logs the pipeline links' training messages (null: none).
  CommitmentLog* commitments = nullptr;
  // Keeps weight versions for spot checks (null: none).
  AuditWeights* audit_weights = nullptr;
};

class TrainingSession {
 public:
  TrainingSession(const v1::JobSpec& job, ServedPlan plan, SessionParts parts,
                  SessionOptions options);
  ~TrainingSession();

  // Trains the plan's stage on `runtime` (the caller's; it outlives the
  // call) until the job is done and DONE is reported (OK), Abort()
  // (CANCELLED), or the first failure. `stale_weights`: the runtime's
  // weights are older than its siblings' (restored from a checkpoint, or
  // kept while a standby), so a replica adopts theirs before it averages.
  // Called once.
  absl::Status Run(StageRuntime* runtime, bool stale_weights);
  // Ends the session: the inbox closes, every link ends on purpose (no
  // failure is reported for them), the replicas and the tied exchange stop.
  void Abort();
  bool aborted() const { return aborted_; }

  // A new plan in which this session goes on (ServedPlan::ContinuesIn): its
  // pipeline's links and progress stay; the outer sync's replicas change as
  // `next` says, on the compute thread between steps. False, and nothing
  // changes, when `next` does not continue this session (the caller ends
  // it) or the session is not running. Thread-safe.
  bool Amend(const ServedPlan& next);

  // The plan the session started in.
  const ServedPlan& plan() const { return plan_; }
  // The newest plan epoch it serves: its own, or the newest amendment's.
  uint64_t plan_epoch() const { return plan_epoch_; }

 private:
  // Opens (or awaits) the link to `peer`; null when the peer dials this
  // worker (its link joins links->upstream()). A link that cannot be
  // opened is reported like a broken one.
  absl::StatusOr<std::shared_ptr<PipelineLink>> Open(
      const StageWorker& peer, PeerSide side, std::shared_ptr<const LinkValidator> validator);
  // The same as `plan` says, giving up when `*stop`; reports a failure with
  // `report_epoch`.
  absl::StatusOr<std::shared_ptr<PipelineLink>> OpenIn(
      const ServedPlan& plan, const StageWorker& peer, PeerSide side,
      std::shared_ptr<const LinkValidator> validator, const std::atomic<bool>* stop,
      uint64_t report_epoch);
  // The session's link validator for `plan`'s outer-sync peers.
  std::shared_ptr<const LinkValidator> ValidatorFor(const ServedPlan& plan) const;
  // The driver's poll (compute thread): applies an amendment, and attaches
  // the outer links its openers have opened since.
  absl::Status PollAmendments();
  absl::Status ApplyAmendment(const ServedPlan& next);
  void ActivateReplicas();
  // Several pipelines (job.outer): starts the runtime's outer optimizer
  // (unless it runs from an earlier plan), opens the outer-sync links and
  // builds the sync the driver runs.
  absl::Status StartOuterSync(StageRuntime* runtime,
                              std::shared_ptr<const LinkValidator> validator);
  absl::Status ActivateTiedExchange(const StageRuntime& runtime);
  PipelineDriverOptions DriverOptions(const StageRuntime& runtime, const ReplicaRouter* router,
                                      bool stale_weights);
  // After the driver failed on a link: tells the coordinator which one.
  void ReportFailedLink(const PipelineDriver& driver, const absl::Status& ran);
  // Reports the link to `peer_id` on `side` as lost (its relay, if it had
  // one).
  // `epoch`: the link's (0: the session's).
  void ReportLostLink(const std::string& peer_id, PeerSide side, absl::string_view why,
                      uint64_t epoch = 0) const;
  // Downstream links first, then the upstream ones this worker opened.
  void CloseLinks();
  absl::Status ReportDone();
  // Whatever the exit path: the session's links, replicas and exchange end.
  void Finish();

  // The job as this pipeline runs it (ServedPlan::PipelineJob): its share
  // of a step's microbatches. Declared before plan_, which it is made from.
  const v1::JobSpec job_;
  const ServedPlan plan_;
  const SessionParts parts_;
  const SessionOptions options_;
  const std::shared_ptr<Inbox> inbox_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> ran_{false};
  absl::Mutex mu_;
  // The links this session opened or awaited; ended by Abort() and Finish().
  std::vector<std::shared_ptr<PipelineLink>> links_ ABSL_GUARDED_BY(mu_);
  // The outer sync (job.outer with R > 1); Run()'s thread only.
  std::unique_ptr<OuterLinks> outer_links_;
  std::unique_ptr<RuntimeOuterCompute> outer_compute_;
  std::unique_ptr<OuterSync> outer_sync_;
  // The outer-sync links the sync has (the driver reads it; changed on the
  // compute thread), and those the newest plan wants: id -> link epoch.
  std::map<std::string, OuterPeer> outer_peers_;
  std::map<std::string, uint64_t> wanted_outer_;
  // The newest plan served (Run()'s thread); plan_ until an amendment.
  std::unique_ptr<ServedPlan> current_;
  std::atomic<uint64_t> plan_epoch_{0};
  std::atomic<bool> running_{false};
  // An amendment waiting for the compute thread, and the outer links
  // opened for one since.
  struct OpenedLink {
    StageWorker peer;
    uint64_t link_epoch = 0;
    std::shared_ptr<PipelineLink> link;
  };
  std::optional<ServedPlan> pending_plan_ ABSL_GUARDED_BY(mu_);
  std::vector<OpenedLink> opened_ ABSL_GUARDED_BY(mu_);
  // Threads opening an amendment's outer links; they stop at `closing_`.
  std::vector<std::thread> openers_;
  std::atomic<bool> closing_{false};
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_TRAINING_SESSION_H_
