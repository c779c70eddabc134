// The parts a worker session (training_session.h) is built from, behind
// interfaces small enough to fake in a test: the coordinator calls it
// makes and the links it opens. The real ones are CoordinatorClient and
// WorkerLinks (worker_links.h); the stage's replicas are StageReplicas
// (stage_replicas.h).
#ifndef GEOTRAIN_WORKER_SESSION_PARTS_H_
#define GEOTRAIN_WORKER_SESSION_PARTS_H_

#include <atomic>
#include <memory>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "geotrain/v1/coordinator.pb.h"
#include "worker/link_dialer.h"
#include "worker/link_validator.h"
#include "worker/message_sink.h"
#include "worker/pipeline_driver.h"

namespace geotrain {

// The coordinator, as one session speaks to it. Thread-safe.
class SessionCoordinator : public ProgressSink {
 public:
  // Reports and events from now on carry `epoch`.
  virtual void SetEpoch(uint64_t epoch) = 0;
  // Logged and dropped on failure. `peer`: the worker it is about, if any
  // (a lost link names the neighbour at its other end).
  virtual void ReportEvent(const std::string& kind, const std::string& detail,
                           const std::string& peer = "") = 0;
  // The same, carrying `epoch` instead (an outer-sync link's epoch may be
  // later than the session's).
  virtual void ReportEventOfEpoch(uint64_t epoch, const std::string& kind,
                                  const std::string& detail, const std::string& peer) = 0;
  // A last heartbeat, so the status shows the final step and memory.
  virtual void ReportFinalStats(const v1::StageStats& stats) = 0;
  // This stage finished the job's `steps` steps.
  virtual absl::Status ReportDone(int steps) = 0;
};

// The links of one worker: those it opens and the service that answers
// its neighbours' (one plan at a time). Thread-safe.
class SessionLinks {
 public:
  virtual ~SessionLinks() = default;
  // Accepts neighbours' (and outer-sync replicas') links for
  // `validator`'s plan, delivering to `inbox`; `dialling_downstream`: the
  // next stage's workers that dial this one.
  virtual void Activate(std::shared_ptr<const LinkValidator> validator,
                        std::shared_ptr<Inbox> inbox,
                        std::set<std::string> dialling_downstream) = 0;
  // Ends every accepted link and refuses new ones until the next Activate.
  virtual void Deactivate() = 0;
  // Opens the link the plan says this worker opens (direct, or through the
  // plan's relay); its reader delivers to `inbox`. Gives up when `*stop`.
  virtual absl::StatusOr<std::shared_ptr<PipelineLink>> Dial(
      const DialTarget& target, std::shared_ptr<const LinkValidator> validator,
      std::shared_ptr<Inbox> inbox, const std::atomic<bool>* stop) = 0;
  // The link the downstream worker (or the replica, `side`) `peer_id`
  // dials in, once it has.
  virtual absl::StatusOr<std::shared_ptr<PipelineLink>> AwaitDialIn(
      PeerSide side, const std::string& peer_id, const std::atomic<bool>* stop) = 0;
  // Where gradients go: back on the link each activation came on.
  virtual MessageSink* upstream() = 0;
  // How long a clean close waits for a peer.
  virtual absl::Duration close_timeout() const = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_SESSION_PARTS_H_
