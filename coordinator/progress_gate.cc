#include "coordinator/progress_gate.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace geotrain {

void ProgressGate::StartEpoch(uint64_t epoch, int committed_step,
                              std::set<std::string> first_stage,
                              std::set<std::string> last_stage) {
  absl::MutexLock lock(&mu_);
  epoch_ = epoch;
  committed_ = std::max(committed_, committed_step);
  first_stage_step_ = committed_;
  single_worker_ = std::any_of(first_stage.begin(), first_stage.end(),
                               [&](const std::string& id) { return last_stage.count(id) > 0; });
  first_stage_ = std::move(first_stage);
  last_stage_ = std::move(last_stage);
  held_.clear();
}

absl::StatusOr<std::vector<ProgressGate::Step>> ProgressGate::Claim(const std::string& worker_id,
                                                                    uint64_t epoch,
                                                                    const Step& step) {
  absl::MutexLock lock(&mu_);
  if (epoch != epoch_ || last_stage_.count(worker_id) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step.step, " claimed outside the last stage of epoch ", epoch_));
  }
  if (step.step <= committed_ || held_.count(step.step) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step.step, " already reported (at ", committed_, ")"));
  }
  if (step.step > options_.total_steps) {
    return absl::OutOfRangeError(absl::StrCat("step ", step.step, " of a job of ",
                                              options_.total_steps));
  }
  if (!single_worker_) {
    const int base = std::max(committed_, first_stage_step_);
    if (step.step > base + options_.max_lead_steps) {
      return absl::OutOfRangeError(absl::StrCat(
          "step ", step.step, " claimed while stage 0 has finished step ", first_stage_step_,
          " (at most ", options_.max_lead_steps, " steps ahead)"));
    }
  }
  held_[step.step] = step;
  if (single_worker_) first_stage_step_ = std::max(first_stage_step_, step.step);
  return CommitLocked();
}

std::vector<ProgressGate::Step> ProgressGate::FirstStageFinished(const std::string& worker_id,
                                                                 uint64_t epoch, int step) {
  absl::MutexLock lock(&mu_);
  if (epoch != epoch_ || first_stage_.count(worker_id) == 0 || single_worker_) return {};
  first_stage_step_ = std::max(first_stage_step_, std::min(step, options_.total_steps));
  return CommitLocked();
}

std::vector<ProgressGate::Step> ProgressGate::CommitLocked() {
  std::vector<Step> committed;
  // A claim commits once stage 0 has finished its step. Steps whose claims
  // never came (a report lost on the way) are passed over: the step after
  // them was computed after them.
  while (!held_.empty() && held_.begin()->first <= first_stage_step_) {
    committed.push_back(held_.begin()->second);
    committed_ = held_.begin()->first;
    held_.erase(held_.begin());
  }
  return committed;
}

int ProgressGate::committed_step() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

int ProgressGate::claimed_step() const {
  absl::MutexLock lock(&mu_);
  return held_.empty() ? committed_ : held_.rbegin()->first;
}

int ProgressGate::first_stage_step() const {
  absl::MutexLock lock(&mu_);
  return first_stage_step_;
}

}  // namespace geotrain
