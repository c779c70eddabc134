#include "coordinator/coordinator_store.h"

namespace geotrain {

absl::Status InMemoryCoordinatorStore::WritePlan(const v1::Plan& plan) {
  absl::MutexLock lock(&mu_);
  plan_ = plan;
  ++plan_writes_;
  return absl::OkStatus();
}

absl::Status InMemoryCoordinatorStore::WriteMembers(const v1::CoordinatorState& members) {
  absl::MutexLock lock(&mu_);
  members_ = members;
  return absl::OkStatus();
}

absl::Status InMemoryCoordinatorStore::WriteProgress(const v1::CoordinatorState& progress) {
  absl::MutexLock lock(&mu_);
  progress_ = progress;
  return absl::OkStatus();
}

absl::StatusOr<std::optional<v1::Plan>> InMemoryCoordinatorStore::ReadPlan() const {
  absl::MutexLock lock(&mu_);
  return plan_;
}

absl::StatusOr<std::optional<v1::CoordinatorState>> InMemoryCoordinatorStore::ReadState()
    const {
  absl::MutexLock lock(&mu_);
  return JoinStateParts(members_, progress_);
}

int InMemoryCoordinatorStore::plan_writes() const {
  absl::MutexLock lock(&mu_);
  return plan_writes_;
}

std::optional<v1::CoordinatorState> JoinStateParts(
    const std::optional<v1::CoordinatorState>& members,
    const std::optional<v1::CoordinatorState>& progress) {
  if (!members.has_value() && !progress.has_value()) return std::nullopt;
  v1::CoordinatorState state;
  if (progress.has_value()) {
    state = *progress;
    state.clear_members();
    state.clear_next_worker_number();
  }
  if (members.has_value()) {
    *state.mutable_members() = members->members();
    state.set_next_worker_number(members->next_worker_number());
  }
  return state;
}

}  // namespace geotrain
