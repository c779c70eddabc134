#include "coordinator/cluster_metrics.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "coordinator/watch_view.h"

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
  if (status.has_audits()) {
    const v1::AuditStatus& a = status.audits();
    const std::pair<const char*, int64_t> outcomes[] = {
        {"passed", a.passed()},       {"failed", a.failed()},
        {"verifier_caught", a.verifiers_caught()}, {"undecided", a.undecided()},
        {"disputed", a.disputes()},   {"expired", a.expired()}};
    out.Counter("geotrain_audits_drawn_total", "Spot checks drawn since this coordinator started.",
                job, static_cast<double>(a.drawn()));
    for (const auto& [outcome, count] : outcomes) {
      out.Counter("geotrain_audits_total",
                  "Spot checks closed since this coordinator started, by outcome (failed: two "
                  "verifiers confirmed a mismatch and the worker was evicted).",
                  {{"outcome", outcome}}, static_cast<double>(count));
    }
    out.Gauge("geotrain_audits_open", "Spot checks waiting for evidence or a verdict.", job,
              a.open());
    out.Gauge("geotrain_audit_fraction", "The job's spot-check fraction.", job, a.fraction());
  }
  // Per stage, not per worker: the coordinator's series stay bounded by
  // the plan's stages however many members there are. Each worker's own
  // stage and link series are on its own endpoint (--metrics_listen).
  struct StageFigures {
    int workers = 0;
    double heartbeat_age_max_s = 0;
    double compute_max_s = 0;
    double bubble_max = 0;
    int output_suspects = 0;  // the cheap check on every microbatch
  };
  std::map<int, StageFigures> stages;
  for (const v1::WorkerStatus& w : status.workers()) {
    if (w.state() != v1::WORKER_STATE_TRAINING || w.stage() < 0) continue;
    StageFigures& f = stages[w.stage()];
    ++f.workers;
    f.heartbeat_age_max_s = std::max(f.heartbeat_age_max_s, w.heartbeat_age_s());
    f.compute_max_s = std::max(f.compute_max_s, w.compute_s_per_microbatch());
    f.bubble_max = std::max(f.bubble_max, w.bubble_fraction());
    for (const v1::OutputNormStatus& n : w.output_norms()) {
      if (!n.suspicion().empty()) {
        ++f.output_suspects;
        break;
      }
    }
  }
  for (const auto& [stage, f] : stages) {
    const MetricLabels labels = {{"stage", std::to_string(stage)}};
    out.Gauge("geotrain_stage_workers", "Training workers on the stage (every pipeline's).",
              labels, f.workers);
    out.Gauge("geotrain_stage_heartbeat_age_max_seconds",
              "The oldest heartbeat among the stage's training workers.", labels,
              f.heartbeat_age_max_s);
    out.Gauge("geotrain_stage_compute_max_seconds_per_microbatch",
              "The slowest of the stage's workers: compute per microbatch.", labels,
              f.compute_max_s);
    out.Gauge("geotrain_stage_bubble_max_ratio",
              "The stage's workers' largest bubble (idle) fraction.", labels, f.bubble_max);
    out.Gauge("geotrain_stage_output_norm_suspects",
              "The stage's workers whose activations or gradients, as their neighbours "
              "received them, are far from their replicas' or their own history.",
              labels, f.output_suspects);
  }
  return out;
}

}  // namespace geotrain
