#include "coordinator/status_assembler.h"

#include <algorithm>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/model_profile.h"
#include "common/plan_util.h"
#include "coordinator/watch_view.h"

namespace geotrain {
namespace {

// Where a member stands: its stage, replica and pipeline in `plan`, and
// its state.
struct Placement {
  const v1::StageAssignment* stage = nullptr;
  int replica = 0;
  int pipeline = 0;
  v1::WorkerState state = v1::WORKER_STATE_UNSPECIFIED;
};

Placement PlacementOf(const WorkerRecord& w, const v1::Plan* plan,
                      const std::set<std::string>& done) {
  Placement p;
  if (plan != nullptr) p.stage = StageOf(*plan, w.id, &p.replica);
  if (p.stage != nullptr) p.pipeline = WorkersOf(*p.stage)[p.replica].pipeline;
  if (done.count(w.id) > 0) {
    p.state = v1::WORKER_STATE_DONE;
  } else if (!w.alive) {
    p.state = w.end_reason == "left" ? v1::WORKER_STATE_LEFT : v1::WORKER_STATE_DEAD;
  } else {
    p.state = p.stage != nullptr ? v1::WORKER_STATE_TRAINING : v1::WORKER_STATE_STANDBY;
  }
  return p;
}

bool Matches(const v1::WorkerFilter& filter, const WorkerRecord& w, const Placement& p) {
  if (!filter.state().empty() && filter.state() != WorkerStateName(p.state)) return false;
  if (filter.has_stage() && (p.stage == nullptr || p.stage->stage() != filter.stage())) {
    return false;
  }
  if (filter.has_pipeline() && (p.stage == nullptr || p.pipeline != filter.pipeline())) {
    return false;
  }
  if (!filter.name_contains().empty() && !absl::StrContains(w.name, filter.name_contains()) &&
      !absl::StrContains(w.id, filter.name_contains())) {
    return false;
  }
  return true;
}

void FillWorker(const WorkerRecord& w, const Placement& p, const NetworkMatrix& network,
                int64_t now_ms, v1::WorkerStatus* out) {
  out->set_id(w.id);
  out->set_name(w.name);
  out->set_address(w.address);
  out->set_role(w.relay() ? "relay" : "worker");
  out->set_reachable(!w.reachability.known() || w.reachability.reachable());
  out->set_reachability(w.reachability.known() ? w.reachability.detail() : "not probed");
  out->set_device(w.device.device());
  out->set_gflops(w.device.matmul_gflops());
  out->set_blas(w.device.blas());
  out->set_environment(w.device.environment());
  out->set_memory_bytes(w.device.memory_bytes());
  if (std::optional<NetworkMatrix::Access> access = network.AccessOf(w.id)) {
    out->set_uplink_bps(access->uplink_bps);
    out->set_downlink_bps(access->downlink_bps);
  }
  // Threads as the worker last reported them (they follow the host's
  // workers), else as it joined.
  out->set_threads(w.stats.threads() > 0 ? w.stats.threads() : w.device.threads());
  out->set_threads_reason(w.stats.threads() > 0 ? w.stats.threads_reason()
                                                : w.device.threads_reason());
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
  out->set_dropped_microbatches(stats.dropped_microbatches());
  *out->mutable_links() = stats.links();
  *out->mutable_routes() = stats.routes();
  out->set_weight_averages(stats.weight_averages());
  out->set_outer_rounds(stats.outer_rounds());
  out->set_outer_bytes_sent(stats.outer_bytes_sent());
  out->set_outer_bytes_received(stats.outer_bytes_received());
  if (p.stage != nullptr) {
    out->set_stage(p.stage->stage());
    out->set_layer_begin(p.stage->layer_begin());
    out->set_layer_end(p.stage->layer_end());
    out->set_replica(p.replica);
    out->set_pipeline(p.pipeline);
  }
  out->set_state(p.state);
}

void AddLinks(const v1::Plan& plan, v1::ClusterStatus* status) {
  std::map<std::string, int> stage_of;
  for (const v1::StageAssignment& s : plan.stages()) {
    for (const StageWorker& w : WorkersOf(s)) stage_of[w.id] = s.stage();
  }
  for (const v1::PlannedLink& link : plan.links()) {
    v1::LinkStatus* out = status->add_links();
    out->set_upstream_stage(stage_of[link.upstream_worker()]);
    out->set_upstream_worker(link.upstream_worker());
    out->set_downstream_worker(link.downstream_worker());
    switch (link.dialer()) {
      case v1::LINK_DIALER_DOWNSTREAM: out->set_dialer("downstream"); break;
      case v1::LINK_DIALER_RELAY: out->set_dialer("relay"); break;
      case v1::LINK_DIALER_NONE: out->set_dialer("none"); break;
      default: out->set_dialer("upstream"); break;
    }
    out->set_relay_worker(link.relay_worker());
    out->set_relay_address(link.relay_address());
    out->set_reason(link.reason());
    out->set_outer(link.outer());
  }
}

// Each pipeline's members, newest step and loss, and rate (its last
// stage's primary's microbatches, as that member reported them).
void AddPipelines(const v1::Plan& plan, const ProgressTracker::Figures& figures,
                  const v1::JobSpec& job, const Membership& membership,
                  v1::ClusterStatus* status) {
  for (int r = 0; r < PipelinesOf(plan); ++r) {
    v1::PipelineStatus* p = status->add_pipeline_status();
    p->set_pipeline(r);
    std::string last;
    for (const v1::StageAssignment& stage : plan.stages()) {
      for (const StageWorker& w : WorkersOf(stage, r)) {
        p->add_workers(w.id);
        last = w.id;
      }
    }
    if (auto claim = figures.pipeline_claims.find(r); claim != figures.pipeline_claims.end()) {
      p->set_step(claim->second.first);
      p->set_loss(claim->second.second);
    }
    if (std::optional<WorkerRecord> w = membership.Find(last)) {
      p->set_samples_per_s(w->stats.microbatches_per_s() * job.microbatch_size());
    }
  }
}

void AddCheckpoints(const v1::JobSpec& job, const CheckpointStore& checkpoints,
                    v1::ClusterStatus* status) {
  const std::map<int, std::vector<int>> index = checkpoints.Index();
  std::optional<absl::Time> oldest_newest;  // of the layers' newest checkpoints
  bool every_layer = true;
  for (int layer = 0; layer < NumLayers(job); ++layer) {
    auto it = index.find(layer);
    const bool has = it != index.end() && !it->second.empty();
    status->add_checkpoint_steps(has ? it->second.back() : -1);
    std::optional<absl::Time> written =
        has ? checkpoints.WrittenAt(layer, it->second.back()) : std::nullopt;
    if (!written.has_value()) {
      every_layer = false;
    } else if (!oldest_newest.has_value() || *written < *oldest_newest) {
      oldest_newest = written;
    }
  }
  status->set_checkpoint_age_s(
      every_layer && oldest_newest.has_value()
          ? std::max(0.0, absl::ToDoubleSeconds(absl::Now() - *oldest_newest))
          : -1.0);
}

}  // namespace

absl::StatusOr<v1::ClusterStatus> StatusAssembler::Assemble(
    const v1::ClusterStatusRequest& request) const {
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("status page_size ", request.page_size(), ": must be 0 or more"));
  }
  int offset = 0;
  if (!request.page_token().empty() &&
      (request.page_token().size() > 10 || !absl::SimpleAtoi(request.page_token(), &offset) ||
       offset < 0)) {
    return absl::InvalidArgumentError("status page_token: not one this coordinator gave out");
  }
  const std::string& state = request.filter().state();
  if (!state.empty() && state != "training" && state != "standby" && state != "dead" &&
      state != "left" && state != "done") {
    return absl::InvalidArgumentError(absl::StrCat(
        "status filter state \"", state.substr(0, 32),
        "\": one of training, standby, dead, left, done"));
  }
  const int page_size =
      request.page_size() == 0 ? kMaxPageSize : std::min(request.page_size(), kMaxPageSize);

  const v1::JobSpec& job = *sources_.job;
  const int64_t now_ms = sources_.clock->NowMs();
  const PlanView::PlanPtr plan = sources_.plan->Get();
  const ProgressTracker::Figures figures = sources_.progress->Snapshot();
  const std::vector<WorkerRecord> workers = sources_.membership->Snapshot();

  v1::ClusterStatus status;
  std::vector<const WorkerRecord*> page;
  std::vector<Placement> placements;
  int matched = 0;
  for (const WorkerRecord& w : workers) {
    const Placement p = PlacementOf(w, plan.get(), figures.done_workers);
    ++(*status.mutable_worker_states())[WorkerStateName(p.state)];
    status.set_dropped_microbatches(status.dropped_microbatches() +
                                    w.stats.dropped_microbatches());
    if (!Matches(request.filter(), w, p)) continue;
    if (matched++ < offset || static_cast<int>(page.size()) >= page_size) continue;
    page.push_back(&w);
    placements.push_back(p);
  }
  status.set_workers_total(static_cast<int>(workers.size()));
  status.set_workers_matched(matched);
  if (offset + static_cast<int>(page.size()) < matched) {
    status.set_next_page_token(absl::StrCat(offset + page.size()));
    status.add_truncated(absl::StrCat("showing members ", offset + 1, "-",
                                      offset + page.size(), " of ", matched,
                                      " (next_page_token for more)"));
  }
  std::vector<std::string> ids;
  ids.reserve(page.size());
  for (const WorkerRecord* w : page) ids.push_back(w->id);
  const ControllerFacts facts = sources_.facts(ids);

  status.set_job(job.name());
  status.set_state(facts.done ? "done" : plan != nullptr ? "training" : "waiting");
  status.set_step(figures.step);
  status.set_steps(job.steps());
  status.set_loss(figures.loss);
  status.set_samples(figures.samples);
  status.set_epoch(plan != nullptr ? plan->epoch() : 0);
  if (plan != nullptr) {
    status.set_pipelines(PipelinesOf(*plan));
    *status.mutable_prediction() = facts.prediction;
  }
  status.set_schedule(ScheduleName(job.schedule()));
  if (request.page_size() == 0 || request.include_network()) {
    for (v1::NetworkLink& link : sources_.network->Status(now_ms)) {
      *status.add_network() = std::move(link);
    }
  }
  status.set_val_loss(figures.val_loss);
  status.set_accuracy(figures.accuracy);
  status.set_elapsed_s((now_ms - sources_.start_ms) / 1000.0);
  status.set_samples_per_s(figures.samples_per_s);
  const AuditCoordinator* audits = sources_.audits ? sources_.audits() : nullptr;
  std::map<std::string, std::pair<int64_t, int64_t>> audited;  // passed, failed
  if (audits != nullptr) {
    const AuditFigures f = audits->Figures();
    v1::AuditStatus* a = status.mutable_audits();
    a->set_fraction(job.verification().fraction());
    a->set_drawn(f.counts.drawn);
    a->set_passed(f.counts.passed);
    a->set_failed(f.counts.confirmed);
    a->set_verifiers_caught(f.counts.verifiers_caught);
    a->set_undecided(f.counts.undecided);
    a->set_disputes(f.disputes);
    a->set_expired(f.expired);
    a->set_open(f.open);
    a->set_evidence_bytes(f.evidence_bytes);
    a->set_dropped(f.counts.dropped);
    a->set_evidence_bytes_total(f.evidence_bytes_total);
    a->set_fetched_bytes_total(f.fetched_bytes_total);
    audited = audits->PerWorker();
  }
  for (size_t i = 0; i < page.size(); ++i) {
    v1::WorkerStatus* out = status.add_workers();
    FillWorker(*page[i], placements[i], *sources_.network, now_ms, out);
    if (auto why = facts.suspected.find(page[i]->id); why != facts.suspected.end()) {
      out->set_suspected(why->second);
    }
    if (auto counts = audited.find(page[i]->id); counts != audited.end()) {
      out->set_audits_passed(counts->second.first);
      out->set_audits_failed(counts->second.second);
    }
    if (sources_.norms != nullptr) {
      for (const OutputNorms& n : sources_.norms->NormsOf(page[i]->id)) {
        v1::OutputNormStatus* norms = out->add_output_norms();
        norms->set_kind(n.kind);
        norms->set_rms(n.rms);
        norms->set_replicas_rms(n.replicas_rms);
        norms->set_history_rms(n.history_rms);
        norms->set_suspicion(n.suspicion);
        norms->set_step(n.step);
      }
    }
  }
  for (v1::Event& e : sources_.events->Recent()) *status.add_events() = std::move(e);
  if (plan != nullptr) {
    AddLinks(*plan, &status);
    for (const v1::StageAssignment& s : plan->stages()) {
      v1::StageSummary* summary = status.add_stage_summary();
      summary->set_stage(s.stage());
      summary->set_layer_begin(s.layer_begin());
      summary->set_layer_end(s.layer_end());
      summary->set_workers(static_cast<int>(WorkersOf(s).size()));
    }
    // Also a pipeline left alone that goes on (it may be joined again).
    if (PipelinesOf(*plan) > 1 || plan->pipeline_info_size() > 0) {
      AddPipelines(*plan, figures, job, *sources_.membership, &status);
    }
  }
  AddCheckpoints(job, *sources_.checkpoints, &status);
  for (const auto& [kind, count] : sources_.events->Counts()) {
    (*status.mutable_event_counts())[kind] = count;
  }
  sources_.checkpoint_gate->FillTraffic(status.mutable_state_traffic());
  return status;
}

}  // namespace geotrain
