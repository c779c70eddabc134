#include "coordinator/job_controller.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_spec.h"
#include "common/logging.h"
#include "common/model_profile.h"
#include "coordinator/planner.h"

namespace geotrain {
namespace {

constexpr size_t kMaxEvents = 200;
constexpr size_t kThroughputWindow = 10;  // steps

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobController>> JobController::Create(
    JobControllerOptions options) {
  if (options.clock == nullptr) {
    return absl::InvalidArgumentError("JobController needs a clock");
  }
  absl::StatusOr<StateStore> store = StateStore::Open(options.state_dir);
  if (!store.ok()) return store.status();
  auto controller = std::unique_ptr<JobController>(
      new JobController(std::move(options), *std::move(store)));
  absl::MutexLock lock(&controller->mu_);
  if (!controller->options_.metrics_log_path.empty()) {
    controller->metrics_.open(controller->options_.metrics_log_path,
                              std::ios::out | std::ios::trunc);
    if (!controller->metrics_) {
      return absl::UnavailableError(absl::StrCat(
          "cannot write metrics log ", controller->options_.metrics_log_path));
    }
  }
  controller->AddEventLocked("started", "",
                             absl::StrCat("job ", controller->options_.job.name()));
  return controller;
}

JobController::JobController(JobControllerOptions options, StateStore store)
    : options_(std::move(options)),
      start_ms_(options_.clock->NowMs()),
      membership_(options_.clock, options_.job.lease_ms()),
      store_(std::move(store)) {}

double JobController::ElapsedS() const {
  return (options_.clock->NowMs() - start_ms_) / 1000.0;
}

v1::JoinResponse JobController::Join(const v1::JoinRequest& request) {
  WorkerRecord record =
      membership_.Join(request.name(), request.address(), request.device());
  v1::JoinResponse response;
  response.set_worker_id(record.id);
  response.set_lease_ms(static_cast<int32_t>(membership_.lease_ms()));
  response.set_heartbeat_ms(options_.heartbeat_ms);
  *response.mutable_job() = options_.job;
  absl::MutexLock lock(&mu_);
  AddEventLocked("joined", record.name,
                 absl::StrFormat("%s at %s, %s, %.1f GFLOP/s", record.id,
                                 record.address, request.device().device(),
                                 request.device().matmul_gflops()));
  MaybePlanLocked();
  return response;
}

bool JobController::Heartbeat(const v1::HeartbeatRequest& request) {
  return membership_.Heartbeat(request.worker_id(), request.rss_bytes(), request.step(),
                               request.stats());
}

void JobController::Leave(const std::string& worker_id) {
  if (membership_.Leave(worker_id, "left")) {
    absl::MutexLock lock(&mu_);
    AddEventLocked("left", NameOf(worker_id), worker_id);
  }
}

std::optional<v1::Plan> JobController::WaitForPlan(uint64_t after_epoch,
                                                   absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this, after_epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shutdown_ || (plan_.has_value() && plan_->epoch() > after_epoch);
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (plan_.has_value() && plan_->epoch() > after_epoch) return *plan_;
  return std::nullopt;
}

absl::Status JobController::ReportStep(const v1::StepReport& report) {
  absl::MutexLock lock(&mu_);
  if (!plan_.has_value() || report.epoch() != plan_->epoch()) {
    return absl::FailedPreconditionError(
        absl::StrCat("step report of epoch ", report.epoch(),
                     " refused: current epoch is ",
                     plan_.has_value() ? plan_->epoch() : 0));
  }
  if (report.step() <= step_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", report.step(), " already reported (at ", step_, ")"));
  }
  const double now = ElapsedS();
  step_ = report.step();
  loss_ = report.loss();
  samples_ += report.samples();
  recent_.emplace_back(now, samples_);
  while (recent_.size() > kThroughputWindow + 1) recent_.pop_front();

  std::string rss;
  for (const WorkerRecord& w : membership_.Snapshot()) {
    if (!w.alive) continue;
    absl::StrAppend(&rss, rss.empty() ? "" : ",", "\"", JsonEscape(w.name),
                    "\":", w.rss_bytes);
  }
  WriteMetricsLocked(absl::StrFormat(
      "{\"step\":%d,\"loss\":%.8g,\"samples\":%d,\"time_s\":%.3f,"
      "\"rss_bytes\":{%s}}",
      step_, loss_, samples_, now - training_start_s_, rss));
  return absl::OkStatus();
}

absl::Status JobController::ReportEval(const v1::EvalReport& report) {
  absl::MutexLock lock(&mu_);
  if (!plan_.has_value() || report.epoch() != plan_->epoch()) {
    return absl::FailedPreconditionError("eval report of another epoch");
  }
  val_loss_ = report.val_loss();
  accuracy_ = report.accuracy();
  std::string line = absl::StrFormat(
      "{\"eval\":true,\"step\":%d,\"val_loss\":%.8g,\"samples\":%d",
      report.step(), report.val_loss(), report.samples());
  if (report.has_accuracy()) {
    absl::StrAppend(&line, absl::StrFormat(",\"accuracy\":%.6f", report.accuracy()));
  }
  absl::StrAppend(&line, absl::StrFormat(",\"time_s\":%.3f}",
                                         training_start_s_ < 0
                                             ? 0.0
                                             : ElapsedS() - training_start_s_));
  WriteMetricsLocked(line);
  AddEventLocked("evaluated", NameOf(report.worker_id()),
                 absl::StrFormat("step %d val_loss %.4f%s", report.step(),
                                 report.val_loss(),
                                 report.has_accuracy()
                                     ? absl::StrFormat(" accuracy %.4f",
                                                       report.accuracy())
                                     : ""));
  return absl::OkStatus();
}

absl::Status JobController::ReportDone(const v1::DoneReport& report) {
  absl::MutexLock lock(&mu_);
  if (!plan_.has_value()) {
    return absl::FailedPreconditionError("done reported before any plan");
  }
  bool in_plan = false;
  for (const v1::StageAssignment& s : plan_->stages()) {
    in_plan = in_plan || s.worker_id() == report.worker_id();
  }
  if (!in_plan) {
    return absl::NotFoundError(
        absl::StrCat(report.worker_id(), " has no stage in the plan"));
  }
  done_workers_.insert(report.worker_id());
  AddEventLocked("worker_done", NameOf(report.worker_id()),
                 absl::StrCat("finished at step ", report.step()));
  if (!done_ && done_workers_.size() ==
                    static_cast<size_t>(plan_->stages_size())) {
    done_ = true;
    v1::Plan final_plan = *plan_;
    final_plan.set_epoch(plan_->epoch() + 1);
    final_plan.set_job_done(true);
    AddEventLocked("job_done", "", absl::StrCat("after step ", step_));
    PublishLocked(std::move(final_plan));
  }
  return absl::OkStatus();
}

void JobController::Tick() {
  std::vector<WorkerRecord> expired = membership_.ExpireLeases();
  absl::MutexLock lock(&mu_);
  for (const WorkerRecord& w : expired) {
    AddEventLocked("lost", w.name, absl::StrCat(w.id, ": ", w.end_reason));
  }
  MaybePlanLocked();
}

void JobController::MaybePlanLocked() {
  if (plan_.has_value() || done_) return;
  std::vector<WorkerRecord> live = membership_.LiveWorkers();
  if (static_cast<int>(live.size()) < options_.job.min_workers()) return;
  std::vector<PlannerWorker> candidates;
  for (const WorkerRecord& w : live) {
    candidates.push_back(
        {w.id, w.device.matmul_gflops(), w.device.memory_bytes()});
  }
  absl::StatusOr<std::vector<StageRange>> ranges = PlanStages(
      ProfileLayers(options_.job), candidates, options_.job.max_stages());
  if (!ranges.ok()) {
    AddEventLocked("plan_failed", "", std::string(ranges.status().message()));
    return;
  }
  v1::Plan plan;
  plan.set_epoch(1);
  plan.set_num_layers(NumLayers(options_.job));
  plan.set_start_step(0);
  std::string summary;
  for (size_t k = 0; k < ranges->size(); ++k) {
    const StageRange& r = (*ranges)[k];
    v1::StageAssignment* stage = plan.add_stages();
    stage->set_stage(static_cast<int>(k));
    stage->set_layer_begin(r.layer_begin);
    stage->set_layer_end(r.layer_end);
    stage->set_worker_id(r.worker_id);
    for (const WorkerRecord& w : live) {
      if (w.id == r.worker_id) stage->set_address(w.address);
    }
    absl::StrAppend(&summary, k == 0 ? "" : ", ", "stage ", k, " = layers [",
                    r.layer_begin, ",", r.layer_end, ") on ",
                    NameOf(r.worker_id));
  }
  AddEventLocked("planned", "", absl::StrCat("epoch 1: ", summary));
  training_start_s_ = ElapsedS();
  PublishLocked(std::move(plan));
}

void JobController::PublishLocked(v1::Plan plan) {
  absl::Status written = store_.WritePlan(plan);
  if (!written.ok()) {
    GT_LOG(Warning) << "could not persist plan: " << written.message();
  }
  plan_ = std::move(plan);
}

v1::ClusterStatus JobController::Status() const {
  v1::ClusterStatus status;
  const int64_t now_ms = options_.clock->NowMs();
  std::vector<WorkerRecord> workers = membership_.Snapshot();
  absl::MutexLock lock(&mu_);
  status.set_job(options_.job.name());
  status.set_state(done_ ? "done" : plan_.has_value() ? "training" : "waiting");
  status.set_step(step_);
  status.set_steps(options_.job.steps());
  status.set_loss(loss_);
  status.set_samples(samples_);
  status.set_epoch(plan_.has_value() ? plan_->epoch() : 0);
  status.set_schedule(ScheduleName(options_.job.schedule()));
  status.set_val_loss(val_loss_);
  status.set_accuracy(accuracy_);
  status.set_elapsed_s(ElapsedS());
  if (recent_.size() >= 2 && recent_.back().first > recent_.front().first) {
    status.set_samples_per_s((recent_.back().second - recent_.front().second) /
                             (recent_.back().first - recent_.front().first));
  }
  for (const WorkerRecord& w : workers) {
    v1::WorkerStatus* out = status.add_workers();
    out->set_id(w.id);
    out->set_name(w.name);
    out->set_address(w.address);
    out->set_device(w.device.device());
    out->set_gflops(w.device.matmul_gflops());
    out->set_stage(-1);
    out->set_rss_bytes(w.rss_bytes);
    out->set_step(w.step);
    out->set_heartbeat_age_s((now_ms - w.last_heartbeat_ms) / 1000.0);
    const v1::StageStats& stats = w.stats;
    out->set_schedule(stats.schedule());
    out->set_weight_versions(stats.weight_versions());
    out->set_max_weight_versions(stats.max_weight_versions());
    out->set_weight_bytes(stats.weight_bytes());
    out->set_staleness_max(stats.staleness_max());
    out->set_staleness_mean(stats.staleness_mean());
    out->set_bubble_fraction(stats.bubble_fraction());
    out->set_microbatches_per_s(stats.microbatches_per_s());
    out->set_compute_s_per_microbatch(stats.compute_s_per_microbatch());
    out->set_microbatches(stats.microbatches());
    out->set_peak_rss_bytes(stats.peak_rss_bytes());
    *out->mutable_links() = stats.links();
    if (plan_.has_value()) {
      for (const v1::StageAssignment& s : plan_->stages()) {
        if (s.worker_id() != w.id) continue;
        out->set_stage(s.stage());
        out->set_layer_begin(s.layer_begin());
        out->set_layer_end(s.layer_end());
      }
    }
    if (done_workers_.count(w.id) > 0) {
      out->set_state(v1::WORKER_STATE_DONE);
    } else if (!w.alive) {
      out->set_state(w.end_reason == "left" ? v1::WORKER_STATE_LEFT
                                            : v1::WORKER_STATE_DEAD);
    } else {
      out->set_state(out->stage() >= 0 ? v1::WORKER_STATE_TRAINING
                                       : v1::WORKER_STATE_STANDBY);
    }
  }
  for (const v1::Event& e : events_) *status.add_events() = e;
  return status;
}

bool JobController::done() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

bool JobController::shutting_down() const {
  absl::MutexLock lock(&mu_);
  return shutdown_;
}

void JobController::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
}

void JobController::AddEventLocked(const std::string& kind,
                                   const std::string& worker,
                                   const std::string& detail) {
  v1::Event event;
  event.set_time_s(ElapsedS());
  event.set_kind(kind);
  event.set_worker(worker);
  event.set_detail(detail);
  GT_LOG(Info) << "event " << kind << (worker.empty() ? "" : " " + worker)
               << ": " << detail;
  absl::Status logged = store_.AppendEvent(absl::StrFormat(
      "{\"time_s\":%.3f,\"kind\":\"%s\",\"worker\":\"%s\",\"detail\":\"%s\"}",
      event.time_s(), JsonEscape(kind), JsonEscape(worker), JsonEscape(detail)));
  if (!logged.ok()) GT_LOG(Warning) << logged.message();
  events_.push_back(std::move(event));
  while (events_.size() > kMaxEvents) events_.pop_front();
}

void JobController::WriteMetricsLocked(const std::string& line) {
  if (!metrics_.is_open()) return;
  metrics_ << line << '\n';
  metrics_.flush();
}

std::string JobController::NameOf(const std::string& worker_id) const {
  for (const WorkerRecord& w : membership_.Snapshot()) {
    if (w.id == worker_id) return w.name;
  }
  return worker_id;
}

}  // namespace geotrain
