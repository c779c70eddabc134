// A stage's recent weight versions, kept for spot checks
// (docs/verification.md): an audit names the version an output was
// computed with after the step is committed, when the stage has moved on.
// The driver keeps each version once, before its first forward, with the
// optimizer state it was made with, both held without a copy (an update
// audit needs the state before the update); the audit responder exports
// the few it is asked for on its own thread. Bounded by bytes: the
// oldest versions go first. Thread-safe.
#ifndef GEOTRAIN_WORKER_AUDIT_WEIGHTS_H_
#define GEOTRAIN_WORKER_AUDIT_WEIGHTS_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct KeptWeights {
  int layer_begin = 0;  // which stage they are of
  int64_t version = 0;
  std::string digest;   // StageRuntime::WeightsDigest of them
  // Exports them (StageRuntime::ExportWeightsLater), on any thread.
  std::function<absl::StatusOr<std::vector<v1::LayerCheckpoint>>()> export_layers;
  // The same with the optimizer's state (StageRuntime::ExportWeightsLater
  // with it): the state the update from this version starts from.
  std::function<absl::StatusOr<std::vector<v1::LayerCheckpoint>>()> export_with_state;
  uint64_t bytes = 0;   // what holding them keeps alive (with the state)
  uint64_t weight_bytes = 0;  // the weights alone
};

class AuditWeights {
 public:
  explicit AuditWeights(uint64_t max_bytes = 0) : max_bytes_(max_bytes) {}

  // 0: keeps nothing (no spot checks in this job).
  void SetMaxBytes(uint64_t max_bytes);
  bool enabled() const;
  // Keeps `weights` as the newest version; versions of another stage
  // (another layer_begin) are dropped first.
  void Keep(KeptWeights weights);
  // The newest kept weights of `version` (all are of the stage kept last)
  // whose digest is `digest` (empty: any). A version number recurs after
  // the job rolls back (Plan.rollback_step); the digest an output
  // committed to tells its weights from those computed since.
  std::optional<KeptWeights> Find(int64_t version, const std::string& digest = "") const;
  // The newest version kept of `layer_begin`, if any.
  std::optional<int64_t> newest(int layer_begin) const;
  uint64_t bytes() const;
  size_t versions() const;

 private:
  void TrimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  uint64_t max_bytes_ ABSL_GUARDED_BY(mu_);
  std::deque<KeptWeights> kept_ ABSL_GUARDED_BY(mu_);  // oldest first
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_AUDIT_WEIGHTS_H_
