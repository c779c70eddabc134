// A worker's side of the spot checks during a job (docs/verification.md),
// on a thread of its own so that neither heartbeats nor training wait:
// - evidence: what the coordinator asks for in a heartbeat reply
//   (EvidenceRequest) is looked up in the commitment log and the kept
//   weights and uploaded (Audit.UploadEvidence); what is no longer held is
//   reported as not found, with why;
// - verification: an audit given to this worker is fetched
//   (Audit.FetchAudit), recomputed by a StageVerifier of the audited stage,
//   and its verdict reported (Audit.ReportVerdict).
// The evidence a coordinator can take in one call is bounded
// (kCoordinatorMaxReceiveBytes): a part over it is reported as not found.
#ifndef GEOTRAIN_WORKER_AUDIT_RESPONDER_H_
#define GEOTRAIN_WORKER_AUDIT_RESPONDER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/link_message.h"
#include "geotrain/v1/audit.pb.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/job.pb.h"
#include "worker/audit_weights.h"
#include "worker/commitment_log.h"

namespace geotrain {
class StageVerifier;
}  // namespace geotrain

namespace geotrain {

// The coordinator's audit calls (CoordinatorClient in production).
struct AuditCalls {
  std::function<std::string()> worker_id;
  std::function<absl::Status(const v1::AuditEvidence&)> upload;
  std::function<absl::StatusOr<v1::AuditBundle>(uint64_t audit_id)> fetch;
  std::function<absl::Status(const v1::AuditVerdict&)> report;
};

struct AuditResponderOptions {
  std::string device = "cpu";     // where this worker computes
  const CommitmentLog* log = nullptr;      // not owned
  const AuditWeights* weights = nullptr;   // not owned
  AuditCalls calls;
  size_t max_queued = 256;        // work past this is dropped (and logged)
  uint64_t max_evidence_bytes = 0;  // 0: kCoordinatorMaxReceiveBytes less a margin
  // Fault injection, for tests only (WorkerOptions::tamper_verdict): sees
  // each verdict before it is reported.
  std::function<void(v1::AuditVerdict*)> tamper_verdict;
};

class AuditResponder {
 public:
  explicit AuditResponder(AuditResponderOptions options);
  ~AuditResponder();  // stops the thread
  AuditResponder(const AuditResponder&) = delete;
  AuditResponder& operator=(const AuditResponder&) = delete;

  // The job the verifications are of (the current plan's).
  void SetJob(const v1::JobSpec& job);
  // Queues the work of a heartbeat reply; never blocks.
  void Enqueue(const v1::HeartbeatResponse& response);

  // The evidence part this worker holds for `request` (tests call it
  // directly).
  v1::AuditEvidence Gather(const v1::EvidenceRequest& request) const;
  // Fetches, recomputes and compares; the verdict to report.
  v1::AuditVerdict VerifyBundle(const v1::AuditBundle& bundle);

  struct Counts {
    int64_t evidence_sent = 0, evidence_missing = 0, verified = 0, failed = 0;
  };
  Counts counts() const;

 private:
  struct Work {
    std::optional<v1::EvidenceRequest> evidence;
    uint64_t verify = 0;
  };
  void Loop();
  void Do(const Work& work);
  // What one upload may carry.
  uint64_t EvidenceLimit() const;
  // Gather() for an update audit (EvidenceRequest.update): fills
  // `evidence`, or returns why this worker no longer holds its part.
  std::optional<std::string> GatherUpdate(const v1::EvidenceRequest& request,
                                          v1::AuditEvidence* evidence) const;
  // The verifier of `bundle`'s stage (made anew for another stage or job),
  // or why none could be made.
  absl::StatusOr<StageVerifier*> VerifierFor(const v1::AuditBundle& bundle,
                                             const v1::JobSpec& job);
  // VerifyBundle() for an update audit.
  v1::AuditVerdict VerifyUpdateBundle(const v1::AuditBundle& bundle, const v1::JobSpec& job,
                                      StageVerifier* verifier);
  // Stage 0's input of `microbatch` (labelled `step`) as the audited
  // worker of `bundle.plan` loaded it.
  absl::StatusOr<LinkMessage> FirstStageInput(const v1::AuditBundle& bundle,
                                              const v1::JobSpec& job, StageVerifier* verifier,
                                              int step, uint64_t microbatch);

  const AuditResponderOptions options_;
  mutable absl::Mutex mu_;
  std::deque<Work> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<const v1::JobSpec> job_ ABSL_GUARDED_BY(mu_);
  // The last verifier made, reused while audits are of the same stage and
  // job (building one builds the stage's model). The loop's thread only.
  std::unique_ptr<StageVerifier> verifier_;
  std::shared_ptr<const v1::JobSpec> verifier_job_;  // held: its address is the key's
  std::string verifier_key_;
  Counts counts_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_AUDIT_RESPONDER_H_
