#include "coordinator/progress_gate.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace geotrain {

void ProgressGate::RollBack(int step) {
  absl::MutexLock lock(&mu_);
  committed_ = step;
  pipelines_.clear();
}

void ProgressGate::StartEpoch(uint64_t epoch, int committed_step,
                              std::map<std::string, int> first_stage,
                              std::map<std::string, int> last_stage,
                              std::map<int, PipelineStart> starts) {
  absl::MutexLock lock(&mu_);
  epoch_ = epoch;
  committed_ = std::max(committed_, committed_step);
  int count = 1;
  for (const auto& [id, pipeline] : first_stage) count = std::max(count, pipeline + 1);
  for (const auto& [id, pipeline] : last_stage) count = std::max(count, pipeline + 1);
  std::vector<Pipeline> previous;
  previous.swap(pipelines_);
  pipelines_.assign(count, Pipeline());
  for (int r = 0; r < count; ++r) {
    PipelineStart start{epoch, committed_};
    if (auto it = starts.find(r); it != starts.end()) start = it->second;
    Pipeline& p = pipelines_[r];
    if (start.formed_epoch < epoch && r < static_cast<int>(previous.size()) &&
        previous[r].formed_epoch == start.formed_epoch) {
      p = std::move(previous[r]);  // it goes on as it was
      continue;
    }
    p.formed_epoch = start.formed_epoch;
    p.first_stage_step = std::max(committed_, start.start_step);
    p.ready_step = p.first_stage_step;
  }
  for (Pipeline& p : pipelines_) p.single_worker = false;
  for (const auto& [id, pipeline] : first_stage) {
    auto last = last_stage.find(id);
    if (last != last_stage.end() && last->second == pipeline) {
      pipelines_[pipeline].single_worker = true;
    }
  }
  first_stage_ = std::move(first_stage);
  last_stage_ = std::move(last_stage);
}

absl::StatusOr<std::vector<ProgressGate::Step>> ProgressGate::Claim(const std::string& worker_id,
                                                                    uint64_t epoch,
                                                                    const Step& step) {
  absl::MutexLock lock(&mu_);
  auto last = last_stage_.find(worker_id);
  if (last == last_stage_.end() || epoch != pipelines_[last->second].formed_epoch) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step.step, " claimed outside the last stage of epoch ", epoch_));
  }
  Pipeline& p = pipelines_[last->second];
  if (step.step <= std::max(committed_, p.ready_step) || p.held.count(step.step) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step.step, " already reported (at ", committed_, ")"));
  }
  if (step.step > options_.total_steps) {
    return absl::OutOfRangeError(absl::StrCat("step ", step.step, " of a job of ",
                                              options_.total_steps));
  }
  if (!p.single_worker) {
    const int base = std::max(committed_, p.first_stage_step);
    if (step.step > base + options_.max_lead_steps) {
      return absl::OutOfRangeError(absl::StrCat(
          "step ", step.step, " claimed while stage 0 has finished step ", p.first_stage_step,
          " (at most ", options_.max_lead_steps, " steps ahead)"));
    }
  }
  p.held[step.step] = step;
  if (p.single_worker) p.first_stage_step = std::max(p.first_stage_step, step.step);
  return CommitLocked();
}

std::vector<ProgressGate::Step> ProgressGate::FirstStageFinished(const std::string& worker_id,
                                                                 uint64_t epoch, int step) {
  absl::MutexLock lock(&mu_);
  auto first = first_stage_.find(worker_id);
  if (first == first_stage_.end() || epoch != pipelines_[first->second].formed_epoch) return {};
  Pipeline& p = pipelines_[first->second];
  if (p.single_worker) return {};
  p.first_stage_step = std::max(p.first_stage_step, std::min(step, options_.total_steps));
  return CommitLocked();
}

std::vector<ProgressGate::Step> ProgressGate::CommitLocked() {
  if (pipelines_.empty()) return {};
  // In each pipeline a claim is corroborated once its stage 0 has finished
  // the step. Steps whose claims never came (a report lost on the way) are
  // passed over: the step after them was computed after them.
  int reached = options_.total_steps;
  for (Pipeline& p : pipelines_) {
    while (!p.held.empty() && p.held.begin()->first <= p.first_stage_step) {
      p.ready_step = p.held.begin()->first;
      p.ready.insert(p.held.extract(p.held.begin()));
    }
    reached = std::min(reached, p.ready_step);
  }
  // A step of the job commits once every pipeline has finished it.
  std::vector<Step> committed;
  for (int step = committed_ + 1; step <= reached; ++step) {
    Step total{step, 0, 0};
    int claims = 0;
    double loss_sum = 0;
    for (size_t r = 0; r < pipelines_.size(); ++r) {
      Pipeline& p = pipelines_[r];
      auto it = p.ready.find(step);
      if (it == p.ready.end()) continue;
      if (pipelines_.size() > 1) total.pipeline_losses.emplace_back(static_cast<int>(r), it->second.loss);
      ++claims;
      total.samples += it->second.samples;
      loss_sum += it->second.loss * static_cast<double>(std::max<int64_t>(it->second.samples, 1));
    }
    if (claims == 0) continue;
    int64_t weight = 0;
    for (Pipeline& p : pipelines_) {
      auto it = p.ready.find(step);
      if (it != p.ready.end()) weight += std::max<int64_t>(it->second.samples, 1);
    }
    total.loss = loss_sum / static_cast<double>(weight);
    committed.push_back(total);
  }
  if (reached > committed_) {
    committed_ = reached;
    for (Pipeline& p : pipelines_) p.ready.erase(p.ready.begin(), p.ready.upper_bound(reached));
  }
  return committed;
}

int ProgressGate::committed_step() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

int ProgressGate::claimed_step() const {
  absl::MutexLock lock(&mu_);
  int claimed = committed_;
  for (const Pipeline& p : pipelines_) {
    if (!p.held.empty()) claimed = std::max(claimed, p.held.rbegin()->first);
    claimed = std::max(claimed, p.ready_step);
  }
  return claimed;
}

int ProgressGate::SlowestLocked() const {
  int slowest = 0;
  for (size_t r = 1; r < pipelines_.size(); ++r) {
    if (pipelines_[r].first_stage_step < pipelines_[slowest].first_stage_step) {
      slowest = static_cast<int>(r);
    }
  }
  return slowest;
}

int ProgressGate::slowest_pipeline() const {
  absl::MutexLock lock(&mu_);
  return SlowestLocked();
}

int ProgressGate::first_stage_step() const {
  absl::MutexLock lock(&mu_);
  return pipelines_.empty() ? committed_ : pipelines_[SlowestLocked()].first_stage_step;
}

int ProgressGate::first_stage_step(int pipeline) const {
  absl::MutexLock lock(&mu_);
  if (pipeline < 0 || pipeline >= static_cast<int>(pipelines_.size())) return committed_;
  return pipelines_[pipeline].first_stage_step;
}

}  // namespace geotrain
