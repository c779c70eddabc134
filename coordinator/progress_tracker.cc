#include "coordinator/progress_tracker.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/learning_rate.h"
#include "common/plan_util.h"
#include "coordinator/stage_series.h"

namespace geotrain {
namespace {

ProgressGateOptions GateOptions(const ProgressTrackerOptions& options) {
  ProgressGateOptions gate;
  gate.total_steps = options.job->steps();
  gate.max_lead_steps = options.lead_steps;
  return gate;
}

absl::Status CheckOnLastStage(const v1::Plan& plan, const std::string& worker_id,
                              const char* what) {
  const v1::StageAssignment* stage = StageOf(plan, worker_id);
  if (stage == nullptr || stage->stage() + 1 != plan.stages_size()) {
    return absl::PermissionDeniedError(absl::StrCat(what, " come from the last stage; ",
                                                    worker_id.substr(0, 128), " is not on it"));
  }
  return absl::OkStatus();
}

}  // namespace

ProgressTracker::ProgressTracker(ProgressTrackerOptions options)
    : options_(std::move(options)),
      gate_(GateOptions(options_)),
      metrics_(std::make_unique<MetricsSink>(nullptr)) {}

double ProgressTracker::ElapsedS() const {
  return (options_.clock->NowMs() - options_.start_ms) / 1000.0;
}

void ProgressTracker::Restore(const v1::CoordinatorState& saved, bool has_plan) {
  absl::MutexLock lock(&mu_);
  step_ = saved.step();
  samples_ = saved.samples();
  loss_ = saved.loss();
  val_loss_ = saved.val_loss();
  accuracy_ = saved.accuracy();
  if (has_plan) training_start_s_ = ElapsedS() - saved.training_elapsed_s();
}

void ProgressTracker::SetMetrics(std::unique_ptr<MetricsSink> metrics) {
  absl::MutexLock lock(&mu_);
  metrics_ = std::move(metrics);
  curves_step_ = step_;  // a recovered job's earlier steps have theirs
}

void ProgressTracker::FillState(v1::CoordinatorState* state) const {
  absl::MutexLock lock(&mu_);
  state->set_step(step_);
  state->set_samples(samples_);
  state->set_loss(loss_);
  state->set_training_elapsed_s(training_start_s_ < 0 ? 0 : ElapsedS() - training_start_s_);
  state->set_val_loss(val_loss_);
  state->set_accuracy(accuracy_);
}

void ProgressTracker::StartTraining() {
  absl::MutexLock lock(&mu_);
  training_start_s_ = ElapsedS();
}

int ProgressTracker::CloseEpoch() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  return step_;
}

void ProgressTracker::RollBack(int step) {
  absl::MutexLock lock(&mu_);
  step_ = std::min(step_, step);
  curves_step_ = std::min(curves_step_, step_);
  gate_.RollBack(step_);
}

void ProgressTracker::StartEpoch(const v1::Plan& plan) {
  absl::MutexLock lock(&mu_);
  closed_ = false;
  epoch_started_ms_ = options_.clock->NowMs();
  progress_in_epoch_ = false;
  if (plan.job_done() || plan.stages_size() == 0) return;
  std::map<std::string, int> first, last;  // worker -> pipeline
  for (const StageWorker& w : WorkersOf(plan.stages(0))) first[w.id] = w.pipeline;
  for (const StageWorker& w : WorkersOf(plan.stages(plan.stages_size() - 1))) {
    last[w.id] = w.pipeline;
  }
  std::map<int, ProgressGate::PipelineStart> starts;
  for (const v1::PipelineInfo& info : plan.pipeline_info()) {
    starts[info.pipeline()] = {info.formed_epoch(), info.start_step()};
  }
  gate_.StartEpoch(plan.epoch(), step_, std::move(first), std::move(last), starts);
  // A continuing pipeline's last claim still stands.
  auto continues = [&](int pipeline) {
    auto start = starts.find(pipeline);
    return start != starts.end() && start->second.formed_epoch < plan.epoch();
  };
  for (auto it = pipeline_claims_.begin(); it != pipeline_claims_.end();) {
    it = continues(it->first) ? std::next(it) : pipeline_claims_.erase(it);
  }
  const int64_t now = options_.clock->NowMs();
  std::map<int, int64_t> moved;
  for (int r = 0; r < PipelinesOf(plan); ++r) {
    auto it = pipeline_moved_ms_.find(r);
    moved[r] = continues(r) && it != pipeline_moved_ms_.end() ? it->second : now;
  }
  pipeline_moved_ms_ = std::move(moved);
}

absl::Status ProgressTracker::ReportStep(const v1::StepReport& report) {
  const PlanView::PlanPtr plan = options_.plan->Get();
  if (plan == nullptr || report.epoch() != WorkerSessionEpoch(*plan, report.worker_id())) {
    return absl::FailedPreconditionError(
        absl::StrCat("step report of epoch ", report.epoch(), " refused: this worker's is ",
                     plan != nullptr ? WorkerSessionEpoch(*plan, report.worker_id()) : 0));
  }
  if (!options_.membership->IsLive(report.worker_id())) {
    return absl::PermissionDeniedError(absl::StrCat(
        "step report from ", report.worker_id().substr(0, 128), ", whose lease has ended"));
  }
  const v1::JobSpec& job = *options_.job;
  if (const v1::StageAssignment* stage = StageOf(*plan, report.worker_id());
      stage != nullptr && stage->stage() == 0 && plan->stages_size() > 1) {
    // Stage 0 vouches for the step (see ProgressGate).
    if (report.step() < 1 || report.step() > job.steps()) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage-0 step ", report.step(), " of ", job.steps(), ": refused"));
    }
    FirstStageFinished(report.worker_id(), report.epoch(), report.step());
    return absl::OkStatus();
  }
  if (absl::Status last = CheckOnLastStage(*plan, report.worker_id(), "step reports");
      !last.ok()) {
    return last;
  }
  if (report.step() < 1 || report.step() > job.steps() || !std::isfinite(report.loss()) ||
      report.samples() < 0 ||
      report.samples() > int64_t{job.microbatches()} * job.microbatch_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "step report out of range (step %d of %d, loss %g, %d samples): refused",
        report.step(), job.steps(), report.loss(), report.samples()));
  }
  ProgressGate::Step claim;
  claim.step = report.step();
  claim.loss = report.loss();
  claim.samples = report.samples();
  bool committed_any = false;
  {
    // Under the tracker's lock, as FirstStageFinished's corroborations
    // are: the gate's commits are recorded in its order (two of them
    // racing wrote step 13 before step 12 to the metrics log).
    absl::MutexLock lock(&mu_);
    if (closed_) {
      // UNAVAILABLE: try again shortly. A pipeline that goes on through
      // the new plan still owes this step.
      return absl::UnavailableError(absl::StrCat(
          "step report of epoch ", report.epoch(), " refused: a new plan is being made"));
    }
    absl::StatusOr<std::vector<ProgressGate::Step>> committed =
        gate_.Claim(report.worker_id(), report.epoch(), claim);
    if (absl::IsOutOfRange(committed.status())) {
      const std::string why =
          absl::StrCat("step report refused: ", committed.status().message());
      // One event per worker and plan: a liar repeating itself must not
      // flood the log.
      if (suspected_claims_.size() > options_.max_suspects) suspected_claims_.clear();
      if (suspected_claims_.insert({report.worker_id(), plan->epoch()}).second) {
        options_.events->Add("suspected", options_.membership->NameOf(report.worker_id()), why);
      }
      return absl::FailedPreconditionError(why);
    }
    if (!committed.ok()) return committed.status();
    // Also for a pipeline left alone that goes on (its status row).
    if (PipelinesOf(*plan) > 1 || plan->pipeline_info_size() > 0) {
      int index = 0;
      if (const v1::StageAssignment* last = StageOf(*plan, report.worker_id(), &index)) {
        const int pipeline = WorkersOf(*last)[index].pipeline;
        pipeline_claims_[pipeline] = {report.step(), report.loss()};
        if (options_.on_pipeline_loss) options_.on_pipeline_loss(pipeline, report.loss());
        pipeline_moved_ms_[pipeline] = options_.clock->NowMs();
      }
    }
    committed_any = CommitLocked(*committed);
  }
  PersistIf(committed_any);
  return absl::OkStatus();
}

void ProgressTracker::FirstStageFinished(const std::string& worker_id, uint64_t epoch,
                                         int step) {
  bool committed_any = false;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    committed_any = CommitLocked(gate_.FirstStageFinished(worker_id, epoch, step));
  }
  PersistIf(committed_any);
}

bool ProgressTracker::CommitLocked(const std::vector<ProgressGate::Step>& steps) {
  if (steps.empty()) return false;
  const v1::JobSpec& job = *options_.job;
  const double now = ElapsedS();
  const std::vector<std::pair<std::string, int64_t>> rss = options_.membership->LiveRss();
  for (const ProgressGate::Step& step : steps) {
    step_ = step.step;
    loss_ = step.loss;
    samples_ += step.samples;
    StepFigures figures;
    figures.step = step_;
    figures.loss = loss_;
    figures.samples = samples_;
    figures.pipeline_losses = step.pipeline_losses;
    figures.training_s = now - training_start_s_;
    figures.learning_rate =
        job.optimizer().lr() *
        LearningRateScale(job.optimizer(), static_cast<double>(step_) / std::max(1, job.steps()));
    figures.rss_bytes = rss;
    metrics_->RecordStep(now, figures);
  }
  const int64_t now_ms = options_.clock->NowMs();
  if (progress_in_epoch_ && now_ms > last_progress_ms_) {
    const int64_t interval = (now_ms - last_progress_ms_) / static_cast<int64_t>(steps.size());
    step_interval_ms_ = step_interval_ms_ == 0 ? interval : (4 * step_interval_ms_ + interval) / 5;
  }
  progress_in_epoch_ = true;
  last_progress_ms_ = now_ms;
  return true;
}

void ProgressTracker::PersistIf(bool committed) {
  if (committed && options_.persist) options_.persist();
}

absl::Status ProgressTracker::ReportEval(const v1::EvalReport& report) {
  const PlanView::PlanPtr plan = options_.plan->Get();
  if (plan == nullptr || report.epoch() != WorkerSessionEpoch(*plan, report.worker_id())) {
    return absl::FailedPreconditionError("eval report of another epoch");
  }
  if (absl::Status last = CheckOnLastStage(*plan, report.worker_id(), "evaluations");
      !last.ok()) {
    return last;
  }
  if (report.step() < 0 || report.step() > options_.job->steps() ||
      !std::isfinite(report.val_loss()) || !std::isfinite(report.accuracy()) ||
      report.accuracy() < 0 || report.accuracy() > 1 || report.samples() < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "eval report out of range (step %d, val_loss %g, accuracy %g): refused", report.step(),
        report.val_loss(), report.accuracy()));
  }
  {
    absl::MutexLock lock(&mu_);
    val_loss_ = report.val_loss();
    accuracy_ = report.accuracy();
    metrics_->RecordEval(training_start_s_ < 0 ? 0.0 : ElapsedS() - training_start_s_, report);
  }
  options_.events->Add(
      "evaluated", options_.membership->NameOf(report.worker_id()),
      absl::StrFormat("step %d val_loss %.4f%s", report.step(), report.val_loss(),
                      report.has_accuracy() ? absl::StrFormat(" accuracy %.4f", report.accuracy())
                                            : ""));
  return absl::OkStatus();
}

absl::StatusOr<bool> ProgressTracker::ReportDone(const v1::DoneReport& report) {
  const PlanView::PlanPtr plan = options_.plan->Get();
  const v1::JobSpec& job = *options_.job;
  if (plan == nullptr) return absl::FailedPreconditionError("done reported before any plan");
  if (StageOf(*plan, report.worker_id()) == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat(report.worker_id().substr(0, 128), " has no stage in the plan"));
  }
  if (report.step() < 0 || report.step() > job.steps()) {
    return absl::InvalidArgumentError(
        absl::StrCat("done at step ", report.step(), " of ", job.steps(), ": refused"));
  }
  if (!options_.membership->IsLive(report.worker_id())) {
    return absl::PermissionDeniedError(absl::StrCat(
        "done from ", report.worker_id().substr(0, 128), ", whose lease has ended"));
  }
  const std::string name = options_.membership->NameOf(report.worker_id());
  absl::MutexLock lock(&mu_);
  // A stage is done only once the job's every step has been computed, as
  // the last stage and stage 0 together said (ProgressGate). An honest
  // stage that gets here first (its reports still on their way) retries.
  if (step_ < job.steps()) {
    const std::string why =
        absl::StrCat("done refused: the job has done ", step_, " of ", job.steps(), " steps");
    // Far from the end, it cannot be reports on their way: someone lies.
    if (done_refused_.size() > options_.max_suspects) done_refused_.clear();
    if (job.steps() - step_ > options_.lead_steps &&
        done_refused_.insert(report.worker_id()).second) {
      options_.events->Add("suspected", name, why);
    }
    return absl::FailedPreconditionError(why);
  }
  done_workers_.insert(report.worker_id());
  options_.events->Add("worker_done", name, absl::StrCat("finished at step ", report.step()));
  int done_in_plan = 0;
  for (const std::string& id : done_workers_) done_in_plan += StageOf(*plan, id) != nullptr;
  if (all_done_ || done_in_plan != WorkersInPlan(*plan)) return false;
  all_done_ = true;
  return true;
}

void ProgressTracker::WriteStageCurves(bool job_done) {
  const PlanView::PlanPtr plan = options_.plan->Get();
  {
    absl::MutexLock lock(&mu_);
    if (!metrics_->has_curves() || plan == nullptr || curves_step_ >= step_) return;
  }
  const std::vector<WorkerRecord> workers = options_.membership->Snapshot();
  // A stage whose figures never come (dead until a re-plan, or a worker that
  // reports none) holds the curves back this long at most; then the steps
  // get what is known.
  constexpr double kMaxWaitS = 10;
  const double now = ElapsedS();
  absl::MutexLock lock(&mu_);
  if (curves_waiting_since_s_ < 0) curves_waiting_since_s_ = now;
  int covered = step_;
  if (!job_done && now - curves_waiting_since_s_ < kMaxWaitS) {
    for (const v1::StageAssignment& stage : plan->stages()) {
      const auto primary =
          std::find_if(workers.begin(), workers.end(),
                       [&](const WorkerRecord& w) { return w.id == stage.worker_id(); });
      if (primary == workers.end() || !primary->alive ||
          primary->stats.compute_s_per_microbatch() <= 0) {
        return;  // its figures are still to come
      }
      covered = std::min(covered, primary->step);
    }
  }
  if (covered <= curves_step_) return;
  const Scalars series = StageSeries(*plan, workers);
  for (int step = curves_step_ + 1; step <= covered; ++step) {
    metrics_->RecordStageCurves(step, series);
  }
  curves_step_ = covered;
  curves_waiting_since_s_ = curves_step_ < step_ ? now : -1;
}

ProgressTracker::Figures ProgressTracker::Snapshot() const {
  absl::MutexLock lock(&mu_);
  Figures figures;
  figures.step = step_;
  figures.loss = loss_;
  figures.samples = samples_;
  figures.val_loss = val_loss_;
  figures.accuracy = accuracy_;
  figures.samples_per_s = metrics_->SamplesPerSecond();
  figures.seconds_per_sample = metrics_->SecondsPerSample();
  figures.pipeline_claims = pipeline_claims_;
  figures.done_workers = done_workers_;
  return figures;
}

ProgressTracker::Pace ProgressTracker::pace() const {
  absl::MutexLock lock(&mu_);
  Pace pace;
  pace.step = step_;
  pace.any_done = !done_workers_.empty();
  pace.last_progress_ms = last_progress_ms_;
  pace.epoch_started_ms = epoch_started_ms_;
  pace.progress_in_epoch = progress_in_epoch_;
  pace.step_interval_ms = step_interval_ms_;
  pace.pipeline_moved_ms = pipeline_moved_ms_;
  return pace;
}

void ProgressTracker::MarkStallHandled(int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  last_progress_ms_ = now_ms;
}

bool ProgressTracker::IsDone(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  return done_workers_.count(worker_id) > 0;
}

bool ProgressTracker::AnyDone() const {
  absl::MutexLock lock(&mu_);
  return !done_workers_.empty();
}

std::set<std::string> ProgressTracker::DoneWorkers() const {
  absl::MutexLock lock(&mu_);
  return done_workers_;
}

int ProgressTracker::committed_step() const {
  absl::MutexLock lock(&mu_);
  return step_;
}

int ProgressTracker::FirstStageStep(int pipeline) const {
  const int committed = committed_step();
  return std::max(committed, gate_.first_stage_step(pipeline));
}

ProgressHistory ProgressTracker::History() const {
  absl::MutexLock lock(&mu_);
  return metrics_->history();
}

void ProgressTracker::Flush() {
  // Flushed outside the lock: waiting on the disk must not hold up step
  // reports (the sink is set once, before any report).
  MetricsSink* metrics;
  {
    absl::MutexLock lock(&mu_);
    metrics = metrics_.get();
  }
  metrics->Flush();
}

}  // namespace geotrain
