// PlanManager's re-plans, made under its lock and published through the
// publisher (plan_manager.h states the contracts): the standbys and
// replicas a plan can use, the voluntary re-plan, the in-place repair of a
// pipeline, the pipelines formed from standbys, a member's replacement,
// the repartition of a plan that lost a stage, and the planner's search.
// The first plan, the publication and the reactions to members are in
// plan_manager.cc.
#include "coordinator/plan_manager.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_spec.h"
#include "common/logging.h"
#include "common/model_profile.h"
#include "common/plan_util.h"
#include "coordinator/link_assigner.h"
#include "coordinator/pipeline_repair.h"
#include "coordinator/plan_builder.h"
#include "coordinator/state_sources.h"

namespace geotrain {

std::vector<WorkerRecord> PlanManager::StandbysLocked(const v1::Plan& plan) const {
  std::vector<WorkerRecord> standbys;
  for (const WorkerRecord& w : membership_.LiveWorkers()) {
    if (StageOf(plan, w.id) == nullptr && faults_.EligibleStandby(w)) standbys.push_back(w);
  }
  const int64_t heard_since = options_.clock->NowMs() - 2 * options_.heartbeat_ms;
  std::stable_sort(standbys.begin(), standbys.end(),
                   [heard_since](const WorkerRecord& a, const WorkerRecord& b) {
                     const bool a_heard = a.last_heartbeat_ms >= heard_since;
                     const bool b_heard = b.last_heartbeat_ms >= heard_since;
                     if (a_heard != b_heard) return a_heard;
                     return a.device.matmul_gflops() > b.device.matmul_gflops();
                   });
  return standbys;
}

void PlanManager::MarkReplicaCandidatesLocked(PlannerInput* input) const {
  for (PlannerWorkerInfo& w : input->workers) w.may_replicate = faults_.MayReplicate(w.id);
}

bool PlanManager::FillReplicasLocked(v1::Plan* plan, std::string* summary) const {
  const int wanted = options_.job.replicas();
  // The network planner chooses replicas itself, only where they pay
  // (PlannerInput::max_replicas); a voluntary re-plan adds them later.
  if (wanted <= 1 || options_.planner == "network") return false;
  std::vector<WorkerRecord> candidates;
  for (const WorkerRecord& w : StandbysLocked(*plan)) {
    if (faults_.MayReplicate(w.id)) candidates.push_back(w);
  }
  bool added = false;
  size_t next = 0;
  for (int k : ReplicableStages(plan->stages_size())) {
    v1::StageAssignment* stage = plan->mutable_stages(k);
    while (1 + stage->replicas_size() < wanted && next < candidates.size()) {
      const WorkerRecord& w = candidates[next++];
      v1::Replica* replica = stage->add_replicas();
      replica->set_worker_id(w.id);
      replica->set_address(w.address);
      absl::StrAppend(summary, summary->empty() ? "" : ", ", "stage ", k, ": + ", w.name,
                      " (replica)");
      added = true;
    }
  }
  return added;
}

PlannerInput PlanManager::LivePlannerInputLocked(
    const std::vector<WorkerRecord>& candidates) const {
  PlannerInput input = PlannerInputFor(options_.job, candidates, CodecChoice::kPerLink);
  input.links = network_.LinksFor(candidates);
  network_.FillAccess(&input.workers);
  MarkReplicaCandidatesLocked(&input);
  CalibrateWithStageStats(*plan_, candidates, &input);
  return input;
}

void PlanManager::MaybeVoluntaryReplanLocked() {
  // With pipelines (job.outer) too: the current plan is scored as the
  // planner scores R pipelines, so a repaired plan is improved as a whole
  // (members moved between stages and pipelines, the cuts and R changed).
  if (options_.planner != "network" || !plan_.has_value() || done_ || plan_->job_done() ||
      progress_.AnyDone()) {
    return;
  }
  const int64_t now = options_.clock->NowMs();
  if (!replan_policy_.Due(now)) return;
  // Marked before the planner runs: a check that returns early must not run
  // the planner again on the next tick (under this lock).
  replan_policy_.MarkChecked(now);
  // The members a plan may use: the current plan's and the standbys (not
  // the demoted stragglers: a median calibration would bring them back).
  std::vector<WorkerRecord> candidates;
  for (const WorkerRecord& w : membership_.LiveWorkers()) {
    if (faults_.Demoted(w.id) && StageOf(*plan_, w.id) == nullptr) continue;
    if (StageOf(*plan_, w.id) != nullptr || faults_.EligibleStandby(w)) candidates.push_back(w);
  }
  candidates = BoundedCandidatesLocked(std::move(candidates));
  PlannerInput input = LivePlannerInputLocked(candidates);
  const absl::Time started = absl::Now();
  absl::StatusOr<PipelinePlan> best = planner_->Plan(input);
  const double planning_s = absl::ToDoubleSeconds(absl::Now() - started);
  if (!best.ok()) return;
  // Where the planner would train more pipelines than the plan has,
  // standbys first form one at the plan's cuts: nobody moves, no layer is
  // loaded but the newcomers'.
  if (options_.job.has_outer() && best->pipelines > PipelinesOf(*plan_)) {
    const auto standbys = std::count_if(candidates.begin(), candidates.end(), [&](const WorkerRecord& w) {
      return StageOf(*plan_, w.id) == nullptr;
    });
    if (FormPipelineFromStandbysLocked(
            absl::StrCat("the network planner would train ", best->pipelines,
                         " pipelines on the plan's workers and ", standbys, " standbys"))) {
      return;
    }
  }
  // What status shows carries this search's time and candidates.
  auto timed = [&](v1::PlanPrediction prediction) {
    prediction.set_planning_s(planning_s);
    prediction.set_candidates(static_cast<int>(candidates.size()));
    return prediction;
  };
  absl::StatusOr<ReplanComparison> compared = CompareForReplan(
      options_.job, input, candidates, *plan_, *best, checkpoints_->Index(),
      progress_.committed_step());
  if (!compared.ok()) return;  // a failure: the involuntary path handles it
  // What status shows from now on: the current plan on calibrated figures
  // (still the plan an exhaustive search chose, if one did).
  compared->current.planner = planner_->name();
  compared->current.exact = prediction_.exact();
  SetPredictionLocked(timed(PredictionOf(input, compared->current)));
  ReplanCandidate& candidate = compared->candidate;
  candidate.measured_s_per_sample = progress_.Snapshot().seconds_per_sample;
  const ReplanDecision decision = replan_policy_.Decide(candidate, now);
  const bool better_exists =
      candidate.best_s_per_sample < candidate.current_s_per_sample * 0.99;
  if (decision.verdict != ReplanDecision::Verdict::kSwitch) {
    // One event per verdict change, or per 30 s while it stands (a deferred
    // move is looked at every second).
    const int verdict = static_cast<int>(decision.verdict);
    if (better_exists && (verdict != last_replan_verdict_ || now - last_replan_event_ms_ >= 30000)) {
      AddEventLocked("replan_considered", "", decision.reason);
      last_replan_verdict_ = verdict;
      last_replan_event_ms_ = now;
    }
    return;
  }
  last_replan_verdict_ = -1;
  v1::Plan next = PlanProtoFor(*best, input, candidates);
  std::string summary = SummaryOf(*best, candidates);
  FillReplicasLocked(&next, &summary);
  SetPredictionLocked(timed(PredictionOf(input, *best)));
  PublishReplanLocked(std::move(next), absl::StrCat("voluntary: ", decision.reason, "; ", summary));
}

void PlanManager::PublishReplanLocked(v1::Plan next, const std::string& summary) {
  // No step commits from here until the plan starts its epoch: it resumes
  // after exactly this one.
  int start_step = progress_.CloseEpoch();
  replan_policy_.Switched(options_.clock->NowMs());
  next.set_epoch(plan_->epoch() + 1);
  if (pending_rollback_.has_value()) {
    const int committed = start_step;
    start_step = std::min(start_step, *pending_rollback_);
    pending_rollback_.reset();
    next.set_rollback_epoch(next.epoch());
    next.set_rollback_step(start_step);
    AddEventLocked("rolled_back", "",
                   absl::StrCat("epoch ", next.epoch(), ": the job goes back from step ",
                                committed, " to step ", start_step,
                                ", the last trusted state; every worker restores its layers "
                                "from that step's checkpoints",
                                start_step == 0 ? " (none: from the seed)" : ""));
  }
  // Every index drawn so far is below the next plan's data_base, so that
  // a change of pipelines draws no index twice (StageRuntime::SetDataShard).
  next.set_data_base(static_cast<uint64_t>(DataHighWater(*plan_, DataInputLocked())));
  if (next.rollback_epoch() == next.epoch()) {
    // Rolled back, the job draws again what it drew after that step (the
    // rolled-back model never saw it), from the plan then in force.
    for (auto it = data_layouts_.rbegin(); it != data_layouts_.rend(); ++it) {
      if (it->start_step() > start_step) continue;
      next.set_data_base(static_cast<uint64_t>(
          DataIndexAfterStep(*it, start_step, std::max(1, options_.job.microbatches()))));
      break;
    }
  }
  next.set_start_step(start_step);
  AddEventLocked("replanned", "",
                 absl::StrCat("epoch ", next.epoch(), ", resuming after step ", start_step, "; ",
                              summary));
  PublishLocked(std::move(next));
  Persist();
}

bool PlanManager::RepairPipelinesLocked(std::set<std::string> live, const std::string& why) {
  std::vector<StageWorker> standbys;
  for (const WorkerRecord& w : StandbysLocked(*plan_)) {
    if (!faults_.Demoted(w.id)) standbys.push_back({w.id, w.address});
  }
  PipelineRepair repair = RepairPipelines(*plan_, live, standbys,
                                          [this](const std::string& id) { return NameOf(id); });
  if (!repair.changed) return false;
  const std::string reason = why.empty() ? "" : absl::StrCat(", because ", why);
  if (!repair.none_left) {
    waiting_for_workers_ = false;
    PublishReplanLocked(std::move(repair.plan), repair.summary + reason);
    return true;
  }
  // Every pipeline lost a stage: the live workers are partitioned anew.
  RepartitionLocked(live, absl::StrCat(repair.summary, reason, "; "));
  return true;
}

bool PlanManager::MaybeFormPipelineLocked() {
  // The network planner forms one only where it would now choose more
  // pipelines: MaybeVoluntaryReplanLocked looks, once per re-plan interval.
  if (options_.planner == "network") return false;
  return FormPipelineFromStandbysLocked("");
}

bool PlanManager::FormPipelineFromStandbysLocked(const std::string& why) {
  if (!options_.job.has_outer() || progress_.AnyDone() || plan_->stages_size() == 0) {
    return false;
  }
  const int pipelines = PipelinesOf(*plan_);
  const int most = PipelineCap(options_.job);
  if (most > 0 && pipelines >= most) return false;
  std::vector<WorkerRecord> spares;
  for (const WorkerRecord& w : StandbysLocked(*plan_)) {
    if (!faults_.Demoted(w.id) && faults_.MayReplicate(w.id)) spares.push_back(w);
  }
  const int stages = plan_->stages_size();
  if (static_cast<int>(spares.size()) < stages) return false;
  if (!why.empty()) {
    AddEventLocked("replan_considered", "",
                   absl::StrCat(why, "; forming one from standbys at the current cuts"));
  }
  // The fastest standbys, one per stage at the plan's cuts, as pipeline R.
  v1::Plan next = *plan_;
  std::string names;
  for (int k = 0; k < stages; ++k) {
    std::vector<StageWorker> workers = WorkersOf(next.stages(k));
    workers.push_back({spares[k].id, spares[k].address, pipelines});
    SetStageWorkers(next.mutable_stages(k), std::move(workers));
    absl::StrAppend(&names, k == 0 ? "" : ", ", spares[k].name);
  }
  next.set_pipelines(pipelines + 1);
  waiting_for_workers_ = false;
  PublishReplanLocked(std::move(next), absl::StrCat("pipeline ", pipelines,
                                                    " formed from standbys ", names));
  return true;
}

void PlanManager::RepartitionLocked(const std::set<std::string>& live,
                                      const std::string& why) {
  std::vector<WorkerRecord> usable;
  for (const WorkerRecord& w : membership_.LiveWorkers()) {
    if (live.count(w.id) > 0 && faults_.EligibleStandby(w)) usable.push_back(w);
  }
  if (usable.empty()) {
    if (!waiting_for_workers_) {
      AddEventLocked("waiting", "", "no live worker to re-plan on; waiting for one to join");
    }
    waiting_for_workers_ = true;
    return;
  }
  std::string partition;
  std::optional<v1::Plan> partitioned = PartitionLocked(usable, &partition);
  if (!partitioned.has_value()) return;
  waiting_for_workers_ = false;
  PublishReplanLocked(*std::move(partitioned),
                      absl::StrCat(why, "re-partitioned over ", usable.size(), " workers: ",
                                   partition));
}

bool PlanManager::ReplaceLocked(const std::string& worker_id, const std::string& why,
                                  Replacement how) {
  int index = 0;
  const v1::StageAssignment* current = StageOf(*plan_, worker_id, &index);
  if (current == nullptr) return false;
  if (PipelinesOf(*plan_) > 1 && how != Replacement::kSwapWithStandby) {
    // Only the worker's own pipeline stops: a standby takes its place, or
    // the pipeline goes.
    std::set<std::string> keep;
    for (const WorkerRecord& w : membership_.LiveWorkers()) {
      if (w.id != worker_id) keep.insert(w.id);
    }
    RepairPipelinesLocked(std::move(keep), why);
    return true;
  }
  const int stage = current->stage();
  v1::Plan next = *plan_;
  v1::StageAssignment* s = next.mutable_stages(stage);
  if (how == Replacement::kSwapWithStandby) {
    std::optional<WorkerRecord> standby;
    for (const WorkerRecord& w : StandbysLocked(*plan_)) {
      if (!faults_.Demoted(w.id)) {
        standby = w;
        break;
      }
    }
    if (!standby.has_value()) return false;
    if (index == 0) {
      s->set_worker_id(standby->id);
      s->set_address(standby->address);
    } else {
      s->mutable_replicas(index - 1)->set_worker_id(standby->id);
      s->mutable_replicas(index - 1)->set_address(standby->address);
    }
    PublishReplanLocked(std::move(next),
                        absl::StrCat("stage ", stage, ": ", NameOf(worker_id), " -> ",
                                     standby->name, " (standby), because ", why));
    return true;
  }
  if (current->replicas_size() > 0) {
    // The stage keeps running on its other workers.
    std::vector<StageWorker> rest;
    for (const StageWorker& w : WorkersOf(*current)) {
      if (w.id != worker_id) rest.push_back(w);
    }
    s->set_worker_id(rest[0].id);
    s->set_address(rest[0].address);
    s->clear_replicas();
    for (size_t i = 1; i < rest.size(); ++i) {
      v1::Replica* replica = s->add_replicas();
      replica->set_worker_id(rest[i].id);
      replica->set_address(rest[i].address);
    }
    PublishReplanLocked(std::move(next),
                        index == 0 ? absl::StrCat("stage ", stage, ": ", NameOf(worker_id), " -> ",
                                                  NameOf(rest[0].id), " (its replica), because ",
                                                  why)
                                   : absl::StrCat("stage ", stage, ": replica ",
                                                  NameOf(worker_id), " removed, because ", why));
    return true;
  }
  const std::vector<WorkerRecord> standbys = StandbysLocked(*plan_);
  if (standbys.empty() && faults_.ExclusionOf(worker_id).has_value()) {
    // It may not keep its stage: the layers go to the others.
    std::vector<WorkerRecord> usable;
    for (const WorkerRecord& w : membership_.LiveWorkers()) {
      if (w.id != worker_id && (StageOf(*plan_, w.id) != nullptr || faults_.EligibleStandby(w))) {
        usable.push_back(w);
      }
    }
    std::string partition;
    std::optional<v1::Plan> partitioned =
        usable.empty() ? std::nullopt : PartitionLocked(usable, &partition);
    if (partitioned.has_value()) {
      PublishReplanLocked(*std::move(partitioned),
                          absl::StrCat(NameOf(worker_id), " is excluded (", why,
                                       "); re-partitioned over ", usable.size(),
                                       " workers: ", partition));
      return true;
    }
  }
  if (standbys.empty()) {
    PublishReplanLocked(std::move(next), absl::StrCat("no standby to replace ", NameOf(worker_id),
                                                      " (", why, "); same stages, new links"));
    return true;
  }
  s->set_worker_id(standbys[0].id);
  s->set_address(standbys[0].address);
  PublishReplanLocked(std::move(next),
                      absl::StrCat("stage ", stage, ": ", NameOf(worker_id), " -> ",
                                   standbys[0].name, " (standby), because ", why));
  return true;
}

void PlanManager::MaybeReplanLocked() {
  if (!plan_.has_value() || done_ || plan_->job_done()) return;
  // The common case, every member of the plan alive (or done), is decided
  // from the plan's members alone: it runs on every join and every tick,
  // and a copy of every member took most of the coordinator at 10,000.
  const std::set<std::string> done_workers = progress_.DoneWorkers();
  bool any_lost = false;
  for (const v1::StageAssignment& stage : plan_->stages()) {
    for (const StageWorker& w : WorkersOf(stage)) {
      if (done_workers.count(w.id) > 0) continue;
      const std::optional<WorkerRecord> record = membership_.Find(w.id);
      any_lost = any_lost || !record.has_value() || !record->alive || record->relay();
    }
  }
  if (!any_lost) {
    v1::Plan next = *plan_;
    std::string summary;
    if (PipelinesOf(*plan_) > 1 || progress_.AnyDone() || !FillReplicasLocked(&next, &summary)) {
      MaybeFormPipelineLocked();
      return;
    }
    waiting_for_workers_ = false;
    PublishReplanLocked(std::move(next), summary);
    return;
  }
  const std::vector<WorkerRecord> live = membership_.LiveWorkers();
  std::set<std::string> live_ids;
  for (const WorkerRecord& w : live) live_ids.insert(w.id);
  // A worker that reported DONE has finished its part and may exit: it is
  // not lost. (With pipelines one finishes before another, and its
  // workers' leases run out while the others' final rounds go on.)
  for (const std::string& id : progress_.DoneWorkers()) live_ids.insert(id);
  if (PipelinesOf(*plan_) > 1) {
    if (!RepairPipelinesLocked(live_ids)) MaybeFormPipelineLocked();
    return;
  }
  v1::Plan next = *plan_;
  std::string summary;
  bool changed = false;
  std::vector<int> orphaned;
  // Dead workers leave their stages; a stage keeps its live workers (the
  // first becomes the primary) and is orphaned when none is left.
  for (v1::StageAssignment& stage : *next.mutable_stages()) {
    const std::vector<StageWorker> workers = WorkersOf(stage);
    std::vector<StageWorker> alive;
    for (const StageWorker& w : workers) {
      if (live_ids.count(w.id) > 0) alive.push_back(w);
    }
    if (alive.size() == workers.size()) continue;
    if (alive.empty()) {
      orphaned.push_back(stage.stage());
      stage.clear_replicas();
      continue;
    }
    changed = true;
    for (const StageWorker& w : workers) {
      if (live_ids.count(w.id) == 0) {
        absl::StrAppend(&summary, summary.empty() ? "" : ", ", "stage ", stage.stage(), ": ",
                        NameOf(w.id), " lost, ", NameOf(alive[0].id), " carries on");
      }
    }
    stage.set_worker_id(alive[0].id);
    stage.set_address(alive[0].address);
    stage.clear_replicas();
    for (size_t i = 1; i < alive.size(); ++i) {
      v1::Replica* replica = stage.add_replicas();
      replica->set_worker_id(alive[i].id);
      replica->set_address(alive[i].address);
    }
  }
  if (!orphaned.empty()) {
    // Standbys first; then replicas taken from stages that have some.
    std::vector<std::pair<StageWorker, std::string>> spares;  // and where from
    for (const WorkerRecord& w : StandbysLocked(next)) {
      spares.push_back({{w.id, w.address}, "standby"});
    }
    for (v1::StageAssignment& stage : *next.mutable_stages()) {
      for (const v1::Replica& r : stage.replicas()) {
        spares.push_back({{r.worker_id(), r.address()},
                          absl::StrCat("a replica of stage ", stage.stage())});
      }
    }
    if (spares.size() < orphaned.size()) {
      RepartitionLocked(live_ids, "no standby; ");
      return;
    }
    for (size_t i = 0; i < orphaned.size(); ++i) {
      const auto& [spare, origin] = spares[i];
      // A spare taken from another stage's replicas leaves that stage.
      for (v1::StageAssignment& stage : *next.mutable_stages()) {
        auto* replicas = stage.mutable_replicas();
        for (auto r = replicas->begin(); r != replicas->end(); ++r) {
          if (r->worker_id() != spare.id) continue;
          replicas->erase(r);
          absl::StrAppend(&summary, summary.empty() ? "" : ", ", "replica ", NameOf(spare.id),
                          " leaves stage ", stage.stage());
          break;
        }
      }
      v1::StageAssignment* stage = next.mutable_stages(orphaned[i]);
      absl::StrAppend(&summary, summary.empty() ? "" : ", ", "stage ", stage->stage(), ": ",
                      NameOf(stage->worker_id()), " -> ", NameOf(spare.id), " (", origin, ")");
      stage->set_worker_id(spare.id);
      stage->set_address(spare.address);
      stage->clear_replicas();
    }
    changed = true;
  }
  // Once a worker has finished the job is ending: an extra replica is not
  // worth a new epoch that aborts the stages still finishing (failures
  // still are: the job cannot end without the stages they hold).
  if (!progress_.AnyDone()) changed = FillReplicasLocked(&next, &summary) || changed;
  if (!changed) {
    MaybeFormPipelineLocked();
    return;
  }
  waiting_for_workers_ = false;
  PublishReplanLocked(std::move(next), summary);
}

std::optional<v1::Plan> PlanManager::PartitionLocked(const std::vector<WorkerRecord>& all_live,
                                                       std::string* summary) {
  const std::vector<WorkerRecord> live = BoundedCandidatesLocked(all_live);
  PlannerInput input = PlannerInputFor(
      options_.job, live,
      options_.planner == "network" ? CodecChoice::kPerLink : CodecChoice::kJobWide);
  input.links = network_.LinksFor(live);
  network_.FillAccess(&input.workers);
  MarkReplicaCandidatesLocked(&input);
  const absl::Time started = absl::Now();
  absl::StatusOr<PipelinePlan> planned = planner_->Plan(input);
  const double planning_s = absl::ToDoubleSeconds(absl::Now() - started);
  if (!planned.ok()) {
    AddEventLocked("plan_failed", "", std::string(planned.status().message()));
    return std::nullopt;
  }
  v1::Plan plan = PlanProtoFor(*planned, input, live);
  absl::StrAppend(summary, SummaryOf(*planned, live));
  v1::PlanPrediction prediction = PredictionOf(input, *planned);
  prediction.set_planning_s(planning_s);
  prediction.set_candidates(static_cast<int>(live.size()));
  SetPredictionLocked(std::move(prediction));
  FillReplicasLocked(&plan, summary);
  return plan;
}

}  // namespace geotrain
