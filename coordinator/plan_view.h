// The plan the coordinator acts on, for the components that only read it
// (CheckpointGate, the status): a snapshot they take without the lock of
// whoever decides plans. The decider sets it with each plan it decides,
// before the plan is durable or visible to the workers (PlanPublisher).
// Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_PLAN_VIEW_H_
#define GEOTRAIN_COORDINATOR_PLAN_VIEW_H_

#include <memory>

#include "absl/synchronization/mutex.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class PlanView {
 public:
  using PlanPtr = std::shared_ptr<const v1::Plan>;

  void Set(PlanPtr plan) {
    absl::MutexLock lock(&mu_);
    plan_ = std::move(plan);
  }
  // Null before the first plan.
  PlanPtr Get() const {
    absl::MutexLock lock(&mu_);
    return plan_;
  }

 private:
  mutable absl::Mutex mu_;
  PlanPtr plan_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PLAN_VIEW_H_
