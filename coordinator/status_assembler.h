// Builds the cluster's status from snapshots of its parts: the members
// (Membership), the plan (PlanView), the progress (ProgressTracker), the
// measured network, the events, the checkpoints. It holds no lock of its
// own and takes none of the controller's but for one short copy of the
// facts only the controller keeps (ControllerFacts); the checkpoint
// files' stat() calls happen with no lock held.
//
// Paginated and filtered (ClusterStatusRequest): the members in join order,
// those matching the filter, a page at a time; the job's figures, the
// counts by state and each stage's size come with every page. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_STATUS_ASSEMBLER_H_
#define GEOTRAIN_COORDINATOR_STATUS_ASSEMBLER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/clock.h"
#include "coordinator/checkpoint_gate.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/event_log.h"
#include "coordinator/membership.h"
#include "coordinator/network_matrix.h"
#include "coordinator/audit_coordinator.h"
#include "coordinator/output_norm_watch.h"
#include "coordinator/plan_view.h"
#include "coordinator/progress_tracker.h"
#include "geotrain/v1/job.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

// What only the controller knows, copied under its lock.
struct ControllerFacts {
  bool done = false;
  v1::PlanPrediction prediction;  // of the current plan
  // Workers the link faults exclude (only with certified callers), with why.
  std::map<std::string, std::string> suspected;
};

struct StatusSources {
  const v1::JobSpec* job = nullptr;  // none owned; all must outlive the assembler
  const Clock* clock = nullptr;
  int64_t start_ms = 0;
  const Membership* membership = nullptr;
  const PlanView* plan = nullptr;
  const ProgressTracker* progress = nullptr;
  const NetworkMatrix* network = nullptr;
  const EventLog* events = nullptr;
  const CheckpointStore* checkpoints = nullptr;
  const CheckpointGate* checkpoint_gate = nullptr;
  const OutputNormWatch* norms = nullptr;  // optional
  // The spot checks (null, or returning null: none).
  std::function<const AuditCoordinator*()> audits;
  // `ids`: the members of the page (whose suspicions are wanted).
  std::function<ControllerFacts(const std::vector<std::string>& ids)> facts;
};

class StatusAssembler {
 public:
  // At most this many members in one reply (and the page size of a
  // request that names none).
  static constexpr int kMaxPageSize = 2000;

  explicit StatusAssembler(StatusSources sources) : sources_(std::move(sources)) {}

  // INVALID_ARGUMENT for a page token this coordinator did not give out,
  // a negative page size or an unknown state in the filter.
  absl::StatusOr<v1::ClusterStatus> Assemble(const v1::ClusterStatusRequest& request) const;

 private:
  const StatusSources sources_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_STATUS_ASSEMBLER_H_
