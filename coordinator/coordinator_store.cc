#include "coordinator/coordinator_store.h"

namespace geotrain {

absl::Status InMemoryCoordinatorStore::WritePlan(const v1::Plan& plan) {
  absl::MutexLock lock(&mu_);
  plan_ = plan;
  ++plan_writes_;
  return absl::OkStatus();
}

absl::Status InMemoryCoordinatorStore::WriteState(const v1::CoordinatorState& state) {
  absl::MutexLock lock(&mu_);
  state_ = state;
  return absl::OkStatus();
}

absl::StatusOr<std::optional<v1::Plan>> InMemoryCoordinatorStore::ReadPlan() const {
  absl::MutexLock lock(&mu_);
  return plan_;
}

absl::StatusOr<std::optional<v1::CoordinatorState>> InMemoryCoordinatorStore::ReadState()
    const {
  absl::MutexLock lock(&mu_);
  return state_;
}

int InMemoryCoordinatorStore::plan_writes() const {
  absl::MutexLock lock(&mu_);
  return plan_writes_;
}

}  // namespace geotrain
