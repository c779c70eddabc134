// The spot checks' bookkeeping (docs/verification.md, issue 35): which
// computations are audited, who verifies them, and what the verdicts
// decide. Torch-free and transport-free: the coordinator's service feeds it
// committed steps and verdicts and carries out its decisions (evidence
// requests, verifier tasks, evictions).
//
// Draws. When a step is committed, stage k's computation of microbatch m
// in each pipeline is audited when the keyed draw (SpotCheckDraw) falls
// below f, or f times `suspect_boost` for a worker the cheap check suspects.
// A stage below the last is audited on its activation; the last stage on
// its gradient (it sends no activation). Stages whose microbatches are
// routed among replicas of one pipeline are not audited: which replica
// computed a microbatch is not in the plan.
//
// Verdicts. A verifier is a worker of the same stage in another pipeline,
// else one of the candidates the caller offers (standbys), chosen by the
// draw so the audited worker cannot predict it, and never the audited
// worker, its neighbours in the audit or a verifier already asked.
// - The first verdict passes: the audit passes.
// - It fails: a second verifier is asked. Both fail: the mismatch is
//   confirmed and the audited worker is to be evicted.
// - They disagree: a third decides. A verifier in the minority lied about
//   a check and is to be evicted itself; a forged accusation never evicts
//   an honest worker on one verifier's word.
// - No verifier left to ask: the audit is undecided and nobody is evicted.
// - Unverifiable (topk with error feedback; an update with weight syncs
//   between): whether a bundle can be recomputed follows from its
//   evidence alone, so every honest verifier says the same. A second
//   verifier is asked; two that say unverifiable close the audit so, nobody
//   evicted (nor, with no verifier left, after one). Where verifiers
//   disagree about it, the majority decides whether the audit is
//   verifiable, and those in the minority lied and are to be evicted: a
//   verifier cannot shield a colluder by calling its computations
//   unverifiable.
// A first verdict that passes is not checked again: a verifier that
// passes a wrong computation lets it through this once. Evidence that does
// not hold together (a commitment that does not match) is for the caller
// to find from the hashes, before a verifier is asked; it is not a verdict.
//
// Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_AUDIT_MANAGER_H_
#define GEOTRAIN_COORDINATOR_AUDIT_MANAGER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/spot_check_draw.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"
#include "geotrain/v1/stage.pb.h"

namespace geotrain {

struct AuditOptions {
  double fraction = 0.01;      // f: the job's share of computations audited
  double suspect_boost = 10;   // a suspect's rate is f times this (at most 1)
  int max_verifiers = 3;       // the third settles a disagreement
  size_t max_open_audits = 64;  // drawn past this are dropped (and counted)
  size_t max_closed_kept = 256;
  // Stages below this are not drawn. Stage 0's input is loaded data, which
  // no neighbour's log holds; the live spot checks start at stage 1
  // (AuditCoordinator).
  int first_audited_stage = 0;
  // Update audits (docs/verification.md, "Update audits"): each stage of
  // each pipeline has the update after step s audited at the same rate, by
  // a draw of its own. Only where a step is one update of every stage (the
  // SYNC schedule); `tied_ends`: stage 0 and the last hold the two ends of
  // a tied embedding, whose updates need each other's gradients, and are
  // not drawn.
  bool audit_updates = false;
  bool tied_ends = false;
  // Each layer's parameters (ProfileLayers): a stage whose weights and
  // optimizer state before an update, and weights after it, exceed
  // `max_update_state_bytes` cannot upload them in one call (streamed
  // evidence is still to come), and its updates are not drawn. Empty: all
  // are.
  std::vector<uint64_t> layer_parameters;
  uint64_t bytes_per_parameter = 24;  // AdamW: weights and two moments, before and after
  uint64_t max_update_state_bytes = 0;
  // The most weight syncs (outer steps, replica averaging) an honest
  // stage makes between two steps, per step, on average: an update audit
  // with one between is unverifiable, and its worker's count of such
  // audits is held to this (UnverifiableUpdatesUnexplained). 0: a job with
  // neither.
  double update_sync_rate = 0;
};

// The weight-sync rate of `job` for update_sync_rate: half as much again
// as one outer step every inner_steps (with pipelines) and one averaging
// every replica_sync_every steps (with replicas), and at least 0.05 for
// re-plans and replicas catching up.
double UpdateSyncRate(const v1::JobSpec& job);

// Whether `unverifiable` of a worker's `audits` update audits had weight
// syncs between (by its own committed outputs) is more than a stage syncing at
// `rate` could make: more than rate * n + 4 standard deviations + 4, from
// at least 8 audits. A worker that claims a sync at each update it skips,
// to make its update audits unverifiable, exceeds it; an honest one does
// so with a probability below 1e-5.
bool UnverifiableUpdatesUnexplained(int64_t audits, int64_t unverifiable, double rate);

// One audited computation.
struct Audit {
  enum class State {
    kOpen,          // waiting for a verdict
    kPassed,
    kConfirmed,     // two verifiers found the mismatch: evict the audited
    kVerifierLied,  // outvoted: evict the verifier(s) in the minority
    kUndecided,     // no verifier left to settle it
    kUnverifiable,
  };
  uint64_t id = 0;
  uint64_t epoch = 0;
  int pipeline = 0;
  int stage = 0;
  int step = 0;
  uint64_t microbatch = 0;
  v1::MessageKind kind = v1::MESSAGE_KIND_UNSPECIFIED;
  // An update audit: the update after step `step`. `microbatches` are the
  // step's (`microbatch` is the first), `next_microbatch` the next step's
  // first; `kind` is the kind of the stage's outputs, whose digests fix
  // the weights before and after.
  bool update = false;
  std::vector<uint64_t> microbatches;
  uint64_t next_microbatch = 0;
  std::string audited;
  std::string upstream;    // sent the input (empty on stage 0)
  std::string downstream;  // received the output
  std::vector<std::string> verifiers;  // asked, in order
  std::vector<bool> passed;            // their verifiable verdicts so far, in order
  std::vector<std::string> passed_by;  // who gave each of those
  std::vector<std::string> unverifiable_by;  // who said it cannot be recomputed
  std::vector<std::string> summaries;
  State state = State::kOpen;
};

const char* AuditStateName(Audit::State state);

// What a verdict decides: who is asked next, who is to be evicted, and why.
struct AuditDecision {
  Audit audit;                          // as it stands after the verdict
  std::optional<std::string> ask;       // the next verifier to ask
  std::vector<std::string> evict;       // the workers to evict
  std::string reason;                   // for the event
};

struct AuditCounts {
  int64_t drawn = 0;
  int64_t dropped = 0;  // drawn past max_open_audits
  int64_t passed = 0;
  int64_t confirmed = 0;
  int64_t verifiers_caught = 0;
  int64_t undecided = 0;
  int64_t unverifiable = 0;
};

class AuditManager {
 public:
  AuditManager(SpotCheckDraw draw, AuditOptions options = {});

  // Step `step` of `plan` is committed: draws the audits of its
  // computations, each with its first verifier chosen among the other
  // pipelines' workers of its stage and `standbys`. `is_suspect` raises a
  // worker's rate. Returns the audits opened (those with no verifier to ask
  // are closed as undecided at once and not returned).
  // `step` counts steps finished (from 1); pipeline r's microbatch ids of
  // it are (step - 1) * M_r + j, j < M_r, with M_r its
  // PipelineInfo.microbatches or else `job_microbatches`. With update
  // audits, the update after step `step - 1` is drawn too (its result is
  // what step `step` computed with), when both steps are of `plan`.
  std::vector<Audit> OnStepCommitted(const v1::Plan& plan, int step, int job_microbatches,
                                     const std::vector<std::string>& standbys,
                                     const std::function<bool(const std::string&)>& is_suspect);

  // `verifier`'s verdict on audit `id`. NOT_FOUND for an audit that is not
  // open, PERMISSION_DENIED for a worker that was not asked for this
  // verdict (a verifier answers once).
  absl::StatusOr<AuditDecision> OnVerdict(uint64_t id, const std::string& verifier, bool passed,
                                          bool verifiable, const std::string& summary,
                                          const v1::Plan& plan,
                                          const std::vector<std::string>& standbys);

  // Closes an open audit undecided, without a verdict (its evidence did
  // not come, or did not hold together). False when it is not open.
  bool Abandon(uint64_t id);

  std::optional<Audit> Find(uint64_t id) const;
  std::vector<Audit> Open() const;
  AuditCounts counts() const;
  // Per worker: audits of its computations that passed, and that failed
  // (confirmed).
  std::map<std::string, std::pair<int64_t, int64_t>> PerWorker() const;

 private:
  std::optional<std::string> ChooseVerifierLocked(const Audit& audit, const v1::Plan& plan,
                                                  const std::vector<std::string>& standbys) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseLocked(Audit audit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether an update audit of `stage` can be uploaded (AuditOptions).
  bool UpdateFits(const v1::StageAssignment& stage) const;

  const SpotCheckDraw draw_;
  const AuditOptions options_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Audit> open_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Audit> closed_ ABSL_GUARDED_BY(mu_);  // the newest
  AuditCounts counts_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::pair<int64_t, int64_t>> per_worker_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_AUDIT_MANAGER_H_
