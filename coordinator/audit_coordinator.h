// Spot checks during a job (docs/verification.md): carries out
// AuditManager's decisions over the workers' own outbound calls.
//
// 1. A step is committed: AuditManager draws the audits of its
//    computations and their first verifiers (OnCommitted).
// 2. Each audit needs three parts of evidence, asked for in heartbeat
//    replies (EvidenceRequest) and uploaded by the workers that hold them
//    (AcceptEvidence):
//    - SENT_INPUT: the upstream neighbour's logged ACTIVATION;
//    - CLAIM: the audited stage's logged output, its weights of the version
//      the output names, and the commitment of the input it received;
//    - RECEIPT: the commitment of the output as its receiver logged it.
// 3. The parts must agree before anyone recomputes: the input's commitment
//    with what the audited stage received, the claim's with what its
//    receiver received. A disagreement is a dispute between two workers'
//    logs that a commitment alone cannot settle (either may lie): it is an
//    event naming both, both are audited at the suspect's rate from then
//    on, and nobody is evicted.
// 4. The verifier is told in a heartbeat reply, fetches the assembled audit
//    (Fetch: only the verifier asked) and reports its verdict
//    (AcceptVerdict). AuditManager decides: pass, a second or third
//    verifier, or eviction, which `evict` carries out (the certificate
//    revoked, the lease ended, a re-plan around the worker).
// An audit whose evidence or verdict does not come within its deadline is
// closed undecided, with an event naming who did not answer. A worker is
// evicted once; its other open audits, and those waiting on its verdict,
// close undecided with it.
//
// Update audits (AuditManager) go the same way with more parts: every
// microbatch of the step from the neighbours (SENT_INPUT, SENT_GRADIENT),
// the stage's outputs of the step and of the next one with the weights and
// optimizer state before the update and the weights after it (CLAIM), and
// the receipts of both outputs (RECEIPT).
//
// 5. It keeps the step up to which each worker of the plan is trusted:
//    the plan's start step when it first holds a stage (it had computed
//    nothing yet), raised by each audit of its computations that passes.
//    A stage that skips its updates computes true outputs from wrong
//    weights, so a worker caught in an update is trusted only up to its
//    last passed update audit. An eviction for a confirmed wrong
//    computation carries the evicted worker's (at most the step before the
//    one caught), for the job to
//    roll back to (docs/verification.md,
//    "Rollback"); the lowest over the plan's workers is what the
//    checkpoint store must keep a checkpoint at or before (TrustedFloor).
//
// Bounded: at most AuditOptions::max_open_audits open, and at most
// `max_evidence_bytes` of uploaded evidence held (a part past it is refused
// and its audit closed undecided). Thread-safe; it holds its own lock only.
#ifndef GEOTRAIN_COORDINATOR_AUDIT_COORDINATOR_H_
#define GEOTRAIN_COORDINATOR_AUDIT_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/audit_manager.h"
#include "coordinator/event_log.h"
#include "geotrain/v1/audit.pb.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct AuditCoordinatorOptions {
  AuditOptions audits;
  const Clock* clock = nullptr;  // not owned, required
  EventLog* events = nullptr;    // not owned, required
  // A worker's name for events (the id when empty).
  std::function<std::string(const std::string& id)> name_of;
  // Evicts a worker whose computation two verifiers failed, or a verifier
  // outvoted: revokes its certificate and ends its lease. For a wrong
  // computation, `trusted_step` is the step up to which the worker's
  // computations are trusted (see 5 above): the job rolls back to it. A
  // lying verifier computed nothing the job used: nullopt. Required.
  std::function<void(const std::string& worker_id, const std::string& why,
                     std::optional<int> trusted_step)>
      evict;
  // Evidence must be uploaded, and a verdict reported, within these.
  int64_t evidence_timeout_ms = 30000;
  int64_t verdict_timeout_ms = 60000;
  uint64_t max_evidence_bytes = uint64_t{256} << 20;
  // The job's steps: an update's learning-rate position is its step over
  // these (update audits).
  int total_steps = 0;
};

// The audit figures of status (ClusterStatus.audits).
struct AuditFigures {
  AuditCounts counts;
  int64_t disputes = 0;
  int64_t expired = 0;
  int open = 0;
  uint64_t evidence_bytes = 0;
  uint64_t evidence_bytes_total = 0;  // uploaded since the start
  uint64_t fetched_bytes_total = 0;   // fetched by verifiers since the start
};

class AuditCoordinator {
 public:
  AuditCoordinator(SpotCheckDraw draw, AuditCoordinatorOptions options);

  // Steps up to `committed_step` of `plan` are committed: draws the audits
  // of each step not drawn yet (a jump of many steps draws only the last
  // few: max_open_audits bounds them anyway) and asks for their evidence.
  void OnCommitted(const v1::Plan& plan, int committed_step, int job_microbatches,
                   const std::vector<std::string>& standbys);
  // A worker the cheap check (or a dispute) suspects is audited more often.
  void SetSuspicion(std::function<bool(const std::string&)> is_suspect);

  // What `worker_id` is asked for in its heartbeat reply (each request and
  // task is handed out once).
  void FillHeartbeat(const std::string& worker_id, v1::HeartbeatResponse* response);

  // PERMISSION_DENIED for a part `caller` was not asked for (or already
  // gave), RESOURCE_EXHAUSTED past the evidence bound, INVALID_ARGUMENT for
  // a part that is not what was asked (another microbatch or kind).
  absl::Status AcceptEvidence(const std::string& caller, const v1::AuditEvidence& evidence);
  // PERMISSION_DENIED unless `caller` is the verifier asked now.
  absl::StatusOr<v1::AuditBundle> Fetch(const std::string& caller, uint64_t audit_id) const;
  absl::Status AcceptVerdict(const std::string& caller, const v1::AuditVerdict& verdict,
                             const v1::Plan& plan, const std::vector<std::string>& standbys);

  // Closes the audits whose evidence or verdict is overdue. Call
  // periodically.
  void Expire();

  AuditFigures Figures() const;
  // Per worker: its audits passed and failed (confirmed mismatches).
  std::map<std::string, std::pair<int64_t, int64_t>> PerWorker() const {
    return manager_.PerWorker();
  }
  bool Disputed(const std::string& worker_id) const;

  // The lowest step to which a worker of the plan last committed under is
  // trusted; -1 before the first commit.
  int TrustedFloor() const;
  // The job rolled back to `step`: nobody is trusted past it.
  void RolledBack(int step);

 private:
  struct Pending {
    Audit audit;
    int num_stages = 0;
    int layer_begin = 0, layer_end = 0;
    int64_t opened_ms = 0;
    int64_t asked_verifier_ms = 0;  // 0: evidence still owed
    // Who owes which part.
    std::map<v1::EvidenceRequest::Part, std::string> owed;
    // An update audit also needs the downstream gradients (gradients).
    std::optional<v1::AuditEvidence> input, claim, receipt, gradients;
    // Stage 0: the plan the verifier derives the audited worker's data
    // from.
    std::shared_ptr<const v1::Plan> plan;
    uint64_t bytes = 0;
  };
  void AskLocked(const std::string& worker, const Pending& pending, v1::EvidenceRequest::Part part)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // All parts are in: checks that they agree, then asks the verifier.
  void OnEvidenceCompleteLocked(Pending* pending) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes `id` undecided (AuditManager) and forgets its evidence.
  void AbandonLocked(uint64_t id, const std::string& kind, const std::string& worker,
                     const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Name(const std::string& id) const;
  int TrustedFloorLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AuditCoordinatorOptions options_;
  AuditManager manager_;
  mutable absl::Mutex mu_;
  std::function<bool(const std::string&)> is_suspect_ ABSL_GUARDED_BY(mu_);
  int drawn_through_ ABSL_GUARDED_BY(mu_) = 0;  // the last step drawn
  uint64_t drawn_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<v1::EvidenceRequest>> evidence_asks_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<uint64_t>> verify_asks_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> disputed_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> evicted_ ABSL_GUARDED_BY(mu_);
  // Worker -> the steps up to which it is trusted (see 5): its outputs,
  // raised by any audit that passes, and its weights, raised only by
  // update audits that pass (by any audit in a job without them).
  struct Trust {
    int outputs = 0;
    int weights = 0;
  };
  std::map<std::string, Trust> trusted_ ABSL_GUARDED_BY(mu_);
  // Worker -> its update audits closed, and how many of them its own two
  // outputs claimed weight syncs between: held to the job's sync rate
  // (UnverifiableUpdatesUnexplained).
  struct UpdateAudits {
    int64_t closed = 0;
    int64_t with_syncs = 0;
  };
  std::map<std::string, UpdateAudits> update_audits_ ABSL_GUARDED_BY(mu_);
  uint64_t evidence_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t disputes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t expired_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evidence_bytes_total_ ABSL_GUARDED_BY(mu_) = 0;
  mutable uint64_t fetched_bytes_total_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_AUDIT_COORDINATOR_H_
