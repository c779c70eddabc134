#include "coordinator/cluster_metrics.h"

#include <map>
#include <string>
#include <utility>

#include "common/stage_metrics.h"

namespace geotrain {
namespace {

// Event kinds that count as failures, by the reason label they get.
constexpr std::pair<const char*, const char*> kFailureKinds[] = {
    {"lost", "lease_expired"},         {"link_lost", "link_lost"},
    {"left", "left"},                  {"straggler", "straggler"},
    {"plan_failed", "plan_failed"},    {"checkpoint_corrupt", "checkpoint_corrupt"},
    {"checkpoint_refused", "checkpoint_refused"}, {"revoked", "revoked"},
    {"suspected", "suspected"},
};

std::string WorkerStateName(v1::WorkerState state) {
  switch (state) {
    case v1::WORKER_STATE_STANDBY: return "standby";
    case v1::WORKER_STATE_TRAINING: return "training";
    case v1::WORKER_STATE_DEAD: return "dead";
    case v1::WORKER_STATE_LEFT: return "left";
    case v1::WORKER_STATE_DONE: return "done";
    default: return "unknown";
  }
}

// The stage figures a worker reported, as the worker itself exports them.
v1::StageStats StatsOf(const v1::WorkerStatus& w) {
  v1::StageStats s;
  s.set_schedule(w.schedule());
  s.set_weight_versions(w.weight_versions());
  s.set_max_weight_versions(w.max_weight_versions());
  s.set_weight_bytes(w.weight_bytes());
  s.set_staleness_max(w.staleness_max());
  s.set_staleness_mean(w.staleness_mean());
  s.set_bubble_fraction(w.bubble_fraction());
  s.set_microbatches_per_s(w.microbatches_per_s());
  s.set_compute_s_per_microbatch(w.compute_s_per_microbatch());
  s.set_microbatches(w.microbatches());
  s.set_peak_rss_bytes(w.peak_rss_bytes());
  *s.mutable_links() = w.links();
  s.set_dropped_microbatches(w.dropped_microbatches());
  s.set_weight_averages(w.weight_averages());
  s.set_threads(w.threads());
  return s;
}

}  // namespace

MetricsSnapshot ClusterMetrics(const v1::ClusterStatus& status) {
  MetricsSnapshot out;
  // A coordinator runs one job: its series carry no job label (Prometheus
  // keeps "job" for the scrape job), and geotrain_job_info names it.
  const MetricLabels job = {};
  out.Gauge("geotrain_job_info", "The training job, its schedule and state (value 1).",
            {{"training_job", status.job()}, {"schedule", status.schedule()},
             {"state", status.state()}},
            1);
  out.Gauge("geotrain_job_step", "The last step every stage finished.", job, status.step());
  out.Gauge("geotrain_job_steps", "The job's length in steps.", job, status.steps());
  out.Counter("geotrain_job_samples_total", "Samples trained.", job,
              static_cast<double>(status.samples()));
  out.Gauge("geotrain_job_samples_per_second", "Training throughput, recent.", job,
            status.samples_per_s());
  out.Gauge("geotrain_job_loss", "Training loss of the last step.", job, status.loss());
  if (status.val_loss() > 0) {
    out.Gauge("geotrain_job_validation_loss", "Loss of the last evaluation.", job,
              status.val_loss());
  }
  if (status.accuracy() > 0) {
    out.Gauge("geotrain_job_validation_accuracy_ratio", "Accuracy of the last evaluation.", job,
              status.accuracy());
  }
  out.Gauge("geotrain_job_elapsed_seconds", "Since the job started.", job, status.elapsed_s());
  out.Gauge("geotrain_plan_epoch", "The current plan's epoch (each re-plan adds one).", job,
            static_cast<double>(status.epoch()));
  if (status.checkpoint_age_s() >= 0) {
    out.Gauge("geotrain_checkpoint_age_seconds",
              "Since the oldest of the layers' newest checkpoints was written.", job,
              status.checkpoint_age_s());
  }
  out.Counter("geotrain_dropped_microbatches_total",
              "Microbatches in flight on routes that died.", job,
              static_cast<double>(status.dropped_microbatches()));
  std::map<std::string, int> by_state = {
      {"standby", 0}, {"training", 0}, {"dead", 0}, {"left", 0}, {"done", 0}};
  for (const v1::WorkerStatus& w : status.workers()) ++by_state[WorkerStateName(w.state())];
  for (const auto& [state, count] : by_state) {
    out.Gauge("geotrain_workers", "Workers by state.", {{"state", state}}, count);
  }
  auto count_of = [&status](const std::string& kind) -> double {
    auto it = status.event_counts().find(kind);
    return it == status.event_counts().end() ? 0 : static_cast<double>(it->second);
  };
  out.Counter("geotrain_replans_total", "Re-plans since this coordinator started.", job,
              count_of("replanned"));
  for (const auto& [kind, reason] : kFailureKinds) {
    out.Counter("geotrain_failures_total",
                "Failures since this coordinator started, by reason.",
                {{"reason", reason}}, count_of(kind));
  }
  for (const auto& [kind, count] : status.event_counts()) {
    out.Counter("geotrain_events_total", "Events since this coordinator started, by kind.",
                {{"kind", kind}}, static_cast<double>(count));
  }
  for (const v1::WorkerStatus& w : status.workers()) {
    const MetricLabels worker = {{"worker", w.name().empty() ? w.id() : w.name()},
                                 {"stage", std::to_string(w.stage())}};
    out.Gauge("geotrain_worker_heartbeat_age_seconds", "Since the worker's last heartbeat.",
              worker, w.heartbeat_age_s());
    out.Gauge("geotrain_worker_resident_bytes", "The worker's resident memory.", worker,
              static_cast<double>(w.rss_bytes()));
    if (w.state() == v1::WORKER_STATE_TRAINING) AppendStageMetrics(StatsOf(w), worker, &out);
  }
  return out;
}

}  // namespace geotrain
