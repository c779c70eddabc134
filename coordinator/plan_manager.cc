// PlanManager (plan_manager.h): its reactions to members, the first plan,
// the tick, and the publication. The re-plans are in plan_manager_replan.cc.
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
PlanManager::PlanManager(PlanManagerOptions options, PlanManagerParts parts)
    : options_(std::move(options)),
      parts_(std::move(parts)),
      planner_(parts_.planner),
      membership_(*parts_.membership),
      network_(*parts_.network),
      progress_(*parts_.progress),
      reachability_(*parts_.reachability),
      events_(*parts_.events),
      checkpoints_(parts_.checkpoints),
      publisher_(parts_.publisher),
      faults_(*parts_.faults) {}

void PlanManager::Restore(std::optional<v1::Plan> plan, bool done) {
  absl::MutexLock lock(&mu_);
  done_ = done;
  if (!plan.has_value()) return;
  plan_ = std::move(plan);
  parts_.plan_view->Set(std::make_shared<const v1::Plan>(*plan_));
  publisher_->Restore(*plan_);  // durable already: the workers may see it
  progress_.StartEpoch(*plan_);
  // The link figures are not persisted: a voluntary move waits a whole
  // re-plan interval for them to be measured again (on the defaults a
  // restart re-planned a healthy pipeline).
  replan_policy_.MarkChecked(options_.clock->NowMs());
}

void PlanManager::OnJoined(const WorkerRecord& record, const std::string& detail) {
  // A join never waits for the plan lock: while a search holds it, the
  // next Tick (every 100 ms) plans with the newcomer, and a relay that
  // could carry a stranded link is used then ("a relay is usable again").
  if (!mu_.TryLock()) {
    events_.Add("joined", record.name, detail);
    return;
  }
  OnJoinedLocked(record, detail);
  mu_.Unlock();
}

void PlanManager::OnJoinedLocked(const WorkerRecord& record, const std::string& detail) {
  AddEventLocked("joined", record.name, detail);
  if (record.relay()) {
    if (plan_.has_value() && !done_) {
      for (const v1::PlannedLink& link : plan_->links()) {
        if (link.dialer() == v1::LINK_DIALER_NONE) {
          RelinkLocked(absl::StrCat("relay ", NameOf(record.id), " joined"));
          break;
        }
      }
    }
    return;
  }
  MaybeReplanLocked();
  MaybePlanLocked();
}

void PlanManager::OnLeft(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  AddEventLocked("left", NameOf(worker_id), worker_id);
  MaybeReplanLocked();
}

void PlanManager::OnRevoked(const std::string& worker_id,
                            const absl::StatusOr<int>& quarantined,
                            std::optional<int> roll_back_to) {
  absl::MutexLock lock(&mu_);
  AddEventLocked("revoked", NameOf(worker_id),
                 absl::StrCat(worker_id, ": its certificate is denied from now on"));
  if (!quarantined.ok()) {
    AddEventLocked("checkpoint_quarantine_failed", NameOf(worker_id),
                   std::string(quarantined.status().message()));
  } else if (*quarantined > 0) {
    AddEventLocked("checkpoints_quarantined", NameOf(worker_id),
                   absl::StrCat(*quarantined, " checkpoint files it uploaded; restores use "
                                              "the newest of the others"));
  }
  if (roll_back_to.has_value()) {
    pending_rollback_ = std::min(pending_rollback_.value_or(*roll_back_to), *roll_back_to);
  }
  const uint64_t epoch = plan_.has_value() ? plan_->epoch() : 0;
  // Live or not (a lapsed lease not yet expired), it leaves the plan.
  MaybeReplanLocked();
  if (pending_rollback_.has_value() && plan_.has_value() && plan_->epoch() == epoch &&
      plan_->stages_size() > 0 && !plan_->job_done()) {
    PublishReplanLocked(*plan_, "the same workers");
  }
}

void PlanManager::OnReachabilityChanged(const ReachabilityManager::Verdict& verdict) {
  absl::MutexLock lock(&mu_);
  AddEventLocked("reachability", NameOf(verdict.worker_id), verdict.summary);
  if (plan_.has_value() && StageOf(*plan_, verdict.worker_id) != nullptr) {
    RelinkLocked(absl::StrCat("the reachability of ", NameOf(verdict.worker_id), " changed"));
  }
}

void PlanManager::ForgetAbandoned(const std::string& worker_id, const std::string& session,
                                  std::function<void(const std::string&)> forgotten) {
  AbandonedJoin join{worker_id, session, std::move(forgotten)};
  // A join handler never waits for a search (at 10,000 workers, thousands
  // of abandoned joins each held a server thread behind one).
  if (!mu_.TryLock()) {
    absl::MutexLock lock(&abandoned_mu_);
    abandoned_.push_back(std::move(join));
    return;
  }
  ForgetAbandonedLocked(join);
  mu_.Unlock();
}

void PlanManager::ForgetAbandonedLocked(const AbandonedJoin& join) {
  // A member a plan already names stays; its lease runs out as any other.
  if (plan_.has_value() && StageOf(*plan_, join.worker_id) != nullptr) return;
  if (membership_.Abandon(join.worker_id, join.session) && join.forgotten) {
    join.forgotten(join.worker_id);
  }
}

std::vector<WorkerRecord> PlanManager::BoundedCandidatesLocked(
    std::vector<WorkerRecord> workers) const {
  const size_t most = std::max<size_t>(1, options_.max_planner_candidates);
  if (workers.size() <= most) return workers;
  const int64_t heard_since = options_.clock->NowMs() - 2 * options_.heartbeat_ms;
  auto rank = [&](const WorkerRecord& w) {
    const bool planned = plan_.has_value() && StageOf(*plan_, w.id) != nullptr;
    return std::make_tuple(!planned, w.last_heartbeat_ms < heard_since,
                           -w.device.matmul_gflops(), w.join_order);
  };
  std::partial_sort(workers.begin(), workers.begin() + most, workers.end(),
                    [&](const WorkerRecord& a, const WorkerRecord& b) { return rank(a) < rank(b); });
  workers.resize(most);
  // The planner's inputs stay in join order (join-order plans, ties).
  std::sort(workers.begin(), workers.end(), [](const WorkerRecord& a, const WorkerRecord& b) {
    return a.join_order < b.join_order;
  });
  return workers;
}

void PlanManager::FinishJob() {
  absl::MutexLock lock(&mu_);
  if (done_ || !plan_.has_value()) return;
  done_ = true;
  progress_.WriteStageCurves(/*job_done=*/true);
  Persist();
  v1::Plan final_plan = *plan_;
  final_plan.set_epoch(plan_->epoch() + 1);
  final_plan.set_job_done(true);
  AddEventLocked("job_done", "", absl::StrCat("after step ", progress_.committed_step()));
  PublishLocked(std::move(final_plan));
}

void PlanManager::Tick(const std::vector<WorkerRecord>& expired) {
  absl::MutexLock lock(&mu_);
  std::vector<AbandonedJoin> abandoned;
  {
    absl::MutexLock queued(&abandoned_mu_);
    abandoned.swap(abandoned_);
  }
  for (const AbandonedJoin& join : abandoned) ForgetAbandonedLocked(join);
  for (const WorkerRecord& w : expired) {
    // A worker that reported DONE exits: its lease ending is no failure.
    if (progress_.IsDone(w.id)) {
      AddEventLocked("finished", w.name, absl::StrCat(w.id, ": reported done; ", w.end_reason));
    } else {
      AddEventLocked("lost", w.name, absl::StrCat(w.id, ": ", w.end_reason));
    }
  }
  if (plan_.has_value() && !done_ && !plan_->job_done()) {
    // A link left without a relay (the only one was suspended or gone) is
    // re-linked as soon as one is usable again (it heartbeated, or joined).
    const bool stranded = std::any_of(
        plan_->links().begin(), plan_->links().end(),
        [](const v1::PlannedLink& l) { return l.dialer() == v1::LINK_DIALER_NONE; });
    if (stranded && !reachability_.UsableRelays().empty()) {
      RelinkLocked("a relay is usable again");
    }
    for (const WorkerRecord& w : expired) {
      if (!w.relay()) continue;
      const bool used = std::any_of(
          plan_->links().begin(), plan_->links().end(),
          [&w](const v1::PlannedLink& l) { return l.relay_worker() == w.id; });
      if (used) {
        RelinkLocked(absl::StrCat("relay ", NameOf(w.id), " was lost"));
        break;
      }
    }
  }
  MaybeReplanLocked();
  MaybePlanLocked();
  if (plan_.has_value() && !done_ && !plan_->job_done()) {
    // Stragglers: not while the job is ending (see MaybeReplanLocked).
    if (!progress_.AnyDone()) {
      for (const FaultResponder::Action& action : faults_.Stragglers(*plan_)) {
        if (ApplyLocked(action)) break;
      }
    }
    MaybeVoluntaryReplanLocked();
    if (std::optional<FaultResponder::Action> stall = faults_.CheckProgress(*plan_)) {
      ApplyLocked(*stall);
    }
  }
}

ControllerFacts PlanManager::Facts(const std::vector<std::string>& ids) const {
  // Not under mu_: the status never waits for a search.
  ControllerFacts facts;
  facts.done = done_;
  {
    absl::MutexLock lock(&facts_mu_);
    facts.prediction = published_prediction_;
  }
  for (const std::string& id : ids) {
    if (std::optional<std::string> why = faults_.ExclusionOf(id)) facts.suspected[id] = *why;
  }
  return facts;
}

bool PlanManager::done() const { return done_; }

std::string PlanManager::NameOf(const std::string& worker_id) const {
  return membership_.NameOf(worker_id);
}

absl::Status PlanManager::OnWorkerEvent(const v1::WorkerEvent& event) {
  absl::MutexLock lock(&mu_);
  if (!plan_.has_value() || done_) return absl::OkStatus();
  absl::StatusOr<std::optional<FaultResponder::Action>> action = faults_.OnWorkerEvent(
      event, *plan_, LinkEpochOfLocked(event.worker_id(), event.peer()));
  if (!action.ok()) return action.status();
  if (action->has_value()) ApplyLocked(**action);
  return absl::OkStatus();
}

bool PlanManager::ApplyLocked(const FaultResponder::Action& action) {
  bool published = true;
  switch (action.kind) {
    case FaultResponder::Action::Kind::kRelink:
      RelinkLocked(action.why);
      break;
    case FaultResponder::Action::Kind::kTakeOut:
      published = ReplaceLocked(action.worker_id, action.why, Replacement::kTakeOut);
      break;
    case FaultResponder::Action::Kind::kSwapWithStandby:
      published = ReplaceLocked(action.worker_id, action.why, Replacement::kSwapWithStandby);
      break;
  }
  if (action.broken_link) faults_.MarkTakenOut(action.worker_id);
  return published;
}


// How long the first plan waits for a worker's layer timings and probes
// (network planner): its timing budget and a probe per heartbeat for each
// of up to 8 peers, with room.
constexpr int64_t kPreflightWaitMs = 10000;

void PlanManager::MaybePlanLocked() {
  if (plan_.has_value() || done_) return;
  std::vector<WorkerRecord> live = membership_.LiveWorkers();
  if (static_cast<int>(live.size()) < options_.job.min_workers()) {
    quorum_since_ms_ = -1;  // the pre-flight wait starts again with the quorum
    return;
  }
  if (options_.planner == "network") {
    // Pre-flight admission: the first plan waits (a few seconds at most)
    // for every worker's layer timings and probes of its peers, the
    // planner's compute and network figures. Workers keep arriving in a
    // large swarm: once there have been enough for kPreflightWaitMs, the
    // plan goes ahead with those whose figures are in, and the newcomers
    // are standbys until a voluntary re-plan takes them.
    const int64_t now = options_.clock->NowMs();
    if (quorum_since_ms_ < 0) quorum_since_ms_ = now;
    const bool waited = now - quorum_since_ms_ >= kPreflightWaitMs;
    std::vector<WorkerRecord> ready;
    for (const WorkerRecord& w : live) {
      // A worker found ready stays so: each tick looks only at newcomers.
      if (preflight_ready_.count(w.id) > 0 || now - w.joined_ms >= kPreflightWaitMs ||
          (!w.layer_seconds_per_sample.empty() && network_.SampleMeasured(w.id, live) &&
           network_.AccessSettled(w.id, live))) {
        preflight_ready_.insert(w.id);
        ready.push_back(w);
      } else if (!waited) {
        return;
      }
    }
    if (ready.size() < live.size()) {
      if (static_cast<int>(ready.size()) < options_.job.min_workers()) return;
      live = std::move(ready);
    }
    preflight_ready_.clear();
  }
  std::string summary;
  std::optional<v1::Plan> plan = PartitionLocked(live, &summary);
  if (!plan.has_value()) return;
  plan->set_epoch(1);
  plan->set_start_step(0);
  AddEventLocked("planned", "", absl::StrCat("epoch 1: ", summary));
  replan_policy_.MarkChecked(options_.clock->NowMs());  // the first check a whole interval on
  progress_.StartTraining();
  PublishLocked(*std::move(plan));
  Persist();
}

void PlanManager::AssignLinksLocked(v1::Plan* plan) {
  std::map<std::string, WorkerRecord> records;
  for (const WorkerRecord& w : membership_.Snapshot()) records[w.id] = w;
  LinkAssignerInput input;
  input.reachable = [&records](const std::string& id) {
    auto it = records.find(id);
    // Not probed (e.g. a record from before probes): as before, reachable.
    return it == records.end() || !it->second.reachability.known() ||
           it->second.reachability.reachable();
  };
  input.relays = reachability_.UsableRelays();
  input.name_of = [this](const std::string& id) { return NameOf(id); };
  AssignLinks(input, plan);
  for (const v1::PlannedLink& link : plan->links()) {
    if (link.dialer() == v1::LINK_DIALER_NONE) {
      AddEventLocked("link_needs_relay", "", link.reason());
    }
  }
}

void PlanManager::RelinkLocked(const std::string& why) {
  if (!plan_.has_value() || done_ || plan_->job_done()) return;
  PublishReplanLocked(*plan_, why);
}

void PlanManager::PublishLocked(v1::Plan plan) {
  if (plan.rollback_epoch() == 0 && plan_.has_value()) {
    plan.set_rollback_epoch(plan_->rollback_epoch());
    plan.set_rollback_step(plan_->rollback_step());
  }
  // A plan that rolls back continues nothing: no pipeline goes on, and no
  // worker's live state is anyone's source.
  const bool rolls_back = plan.rollback_epoch() > 0 && plan.rollback_epoch() == plan.epoch();
  const v1::Plan* previous = plan_.has_value() && !rolls_back ? &*plan_ : nullptr;
  if (!plan.job_done()) {
    AssignLinksLocked(&plan);
    if (options_.job.has_outer()) {
      const std::set<int> continuing = AssignPipelineInfo(previous, DataInputLocked(), &plan);
      if (!continuing.empty()) {
        std::string which;
        for (int r : continuing) absl::StrAppend(&which, which.empty() ? "" : ", ", r);
        AddEventLocked("pipelines_continue", "",
                       absl::StrCat("epoch ", plan.epoch(), ": pipeline",
                                    continuing.size() == 1 ? " " : "s ", which,
                                    " go on as they were"));
      }
    }
    // After the pipelines' entries: a pipeline formed anew takes no holder.
    AssignStateSources(previous, &plan);
  }
  faults_.PlanChanged();
  // The state naming the plan's members is submitted first; the publisher
  // writes it, then the plan, and only then shows the workers the plan,
  // all off this lock. From here on the controller acts on the plan (a
  // report of the old epoch is refused) while the workers may still see
  // the old one for as long as the write takes.
  Persist();
  publisher_->Submit(plan);
  parts_.plan_view->Set(std::make_shared<const v1::Plan>(plan));
  if (!plan.job_done()) {
    v1::Plan layout;
    layout.set_epoch(plan.epoch());
    layout.set_start_step(plan.start_step());
    if (plan.has_data_base()) layout.set_data_base(plan.data_base());
    layout.set_pipelines(plan.pipelines());
    *layout.mutable_pipeline_info() = plan.pipeline_info();
    data_layouts_.push_back(std::move(layout));
    constexpr size_t kDataLayoutsKept = 64;
    while (data_layouts_.size() > kDataLayoutsKept) data_layouts_.pop_front();
  }
  plan_ = std::move(plan);
  if (rolls_back) progress_.RollBack(plan_->start_step());
  progress_.StartEpoch(*plan_);
}

void PlanManager::SetPredictionLocked(v1::PlanPrediction prediction) {
  prediction_ = prediction;
  absl::MutexLock lock(&facts_mu_);
  published_prediction_ = std::move(prediction);
}

void PlanManager::AddEventLocked(const std::string& kind, const std::string& worker,
                                   const std::string& detail) {
  events_.Add(kind, worker, detail);
}

uint64_t PlanManager::LinkEpochOfLocked(const std::string& reporter,
                                          const std::string& peer) const {
  // A pipeline link's ends share their pipeline's epoch; an outer-sync
  // link's is the later of its ends' (a relay is in no pipeline).
  // A relay, or a worker the plan does not have (its accusation is
  // refused as such): the reporter's.
  const uint64_t mine = WorkerSessionEpoch(*plan_, reporter);
  if (StageOf(*plan_, peer) == nullptr) return mine;
  return std::max(mine, WorkerSessionEpoch(*plan_, peer));
}

PipelineDataInput PlanManager::DataInputLocked() const {
  PipelineDataInput input;
  input.microbatches = std::max(1, options_.job.microbatches());
  input.split_batch = options_.job.outer().split_batch();
  const int window =
      std::max({options_.job.in_flight(), plan_.has_value() ? plan_->in_flight() : 0,
                kMaxPlannedWindow});
  // Split, a pipeline's step may be a single microbatch.
  const int64_t per_step = input.split_batch ? 1 : input.microbatches;
  input.in_flight_steps = static_cast<int>((window + per_step - 1) / per_step);
  input.first_stage_step = [this](int pipeline) { return progress_.FirstStageStep(pipeline); };
  return input;
}

}  // namespace geotrain
