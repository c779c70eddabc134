#include "coordinator/fault_responder.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/plan_util.h"

namespace geotrain {
namespace {

// A worker's event kind and own detail, before the peer's name is added
// (the event log cuts the whole at its own bound).
constexpr size_t kMaxEventKindBytes = 64;
constexpr size_t kMaxEventDetailBytes = 512;
// A worker taken out of the plan for a lost link waits this long before it
// is made a replica again (it may still replace a lost worker before that):
// a link that keeps failing would otherwise cycle it in and out.
constexpr int64_t kReplicaCooldownMs = 30000;
// A new plan's first step may take this long at least (state restored,
// links opened) before the progress watchdog looks for a stall.
constexpr int64_t kStartupGraceMs = 60000;

}  // namespace

FaultResponder::FaultResponder(FaultResponderOptions options)
    : options_(std::move(options)),
      link_faults_(options_.membership->lease_ms()),
      stragglers_(options_.stragglers) {}

absl::Status FaultResponder::Admit(const v1::WorkerEvent& event) {
  if (event.kind().size() > kMaxEventKindBytes) {
    return absl::InvalidArgumentError("event kind longer than 64 bytes");
  }
  const std::string& accuser = event.worker_id();
  if (!options_.membership->Knows(accuser)) {
    return absl::PermissionDeniedError(
        absl::StrCat("event from unknown worker '", accuser.substr(0, 128), "'"));
  }
  const int64_t now = options_.clock->NowMs();
  {
    // Each worker's events come out of a bucket of its own (issue 32: one
    // wrote 3,000 in 1.3 s): a flood is refused, not logged.
    absl::MutexLock lock(&mu_);
    if (event_buckets_.size() > options_.max_buckets && event_buckets_.count(accuser) == 0) {
      event_buckets_.clear();  // ids come and go; a fresh start costs nothing
    }
    auto [bucket, fresh] =
        event_buckets_.try_emplace(accuser, EventBucket{options_.event_burst, now});
    EventBucket& b = bucket->second;
    b.tokens = std::min(options_.event_burst,
                        b.tokens + (now - b.at_ms) / 1000.0 * options_.events_per_s);
    b.at_ms = now;
    if (b.tokens < 1) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "more than %g events a second from %s: refused", options_.events_per_s,
          accuser.substr(0, 128)));
    }
    b.tokens -= 1;
    if (event.kind() == "draining") draining_.insert(accuser);
  }
  options_.events->Add(event.kind(), NameOf(accuser),
                       event.peer().empty()
                           ? event.detail()
                           : absl::StrCat(event.detail().substr(0, kMaxEventDetailBytes),
                                          " (peer ", NameOf(event.peer()).substr(0, 128), ")"));
  return absl::OkStatus();
}

absl::StatusOr<std::optional<FaultResponder::Action>> FaultResponder::OnWorkerEvent(
    const v1::WorkerEvent& event, const v1::Plan& plan, uint64_t link_epoch) {
  // A lost link on the current plan: the neighbour accused is taken out of
  // the pipeline (it stays a standby if it is alive). Only the first report
  // of an epoch counts: the other end of the same link accuses this one.
  // A draining worker closes its links on purpose: not a failure. The
  // report carries the link's epoch (a pipeline that continues through
  // re-plans keeps the one it was formed in): one of a link the current
  // plan no longer has is old news.
  if (event.kind() != "link_lost" || event.epoch() != link_epoch) return std::nullopt;
  const std::string& accuser = event.worker_id();
  const std::string& accused = event.peer();
  absl::MutexLock lock(&mu_);
  if (draining_.count(accused) > 0) return std::nullopt;
  for (const v1::PlannedLink& link : plan.links()) {
    if (link.dialer() != v1::LINK_DIALER_RELAY || link.relay_worker() != accused ||
        (link.upstream_worker() != accuser && link.downstream_worker() != accuser)) {
      continue;
    }
    // A link through a relay broke: its ends are re-linked through another
    // relay (or the same one once it heartbeats again).
    if (!options_.reachability->SuspendRelay(accused, options_.clock->NowMs())) {
      return std::nullopt;  // the other end of the same link, or another link
    }
    Action relink;
    relink.kind = Action::Kind::kRelink;
    relink.why = absl::StrCat("the link of ", NameOf(accuser), " through relay ",
                              NameOf(accused), " was lost");
    return relink;
  }
  const v1::StageAssignment* accuser_stage = StageOf(plan, accuser);
  const v1::StageAssignment* accused_stage = StageOf(plan, accused);
  if (accuser_stage == nullptr || accused_stage == nullptr ||
      std::abs(accuser_stage->stage() - accused_stage->stage()) != 1) {
    const std::string why = absl::StrCat(
        "accusation of ", accused.substr(0, 128), " by ", accuser,
        " refused: they are not neighbours in the plan of epoch ", plan.epoch());
    options_.events->Add("accusation_refused", NameOf(accuser), why);
    return absl::PermissionDeniedError(why);
  }
  return BrokenLinkLocked(accuser, accused, plan.epoch(), "was lost");
}

std::optional<FaultResponder::Action> FaultResponder::BrokenLinkLocked(
    const std::string& reporter, const std::string& accused, uint64_t epoch, const char* how) {
  std::optional<LinkFaultLedger::Verdict> verdict =
      link_faults_.Report(reporter, accused, epoch, options_.clock->NowMs());
  if (!verdict.has_value()) return std::nullopt;  // this break is counted already
  const std::string& out = verdict->take_out;
  // Insecure, anyone may speak for anyone: nobody is excluded on what
  // "they" said.
  if (verdict->exclude && options_.authenticated_callers) {
    options_.events->Add("excluded", NameOf(out),
                         absl::StrCat(out, ": ", verdict->why,
                                      "; no stage until its record clears"));
  }
  Action action;
  action.kind = Action::Kind::kTakeOut;
  action.worker_id = out;
  action.why = out == accused ? absl::StrCat("its link from ", NameOf(reporter), " ", how)
                              : absl::StrCat("its link to ", NameOf(accused), " ", how,
                                             ", and it was in more broken links");
  action.broken_link = true;
  return action;
}

std::vector<FaultResponder::Action> FaultResponder::Stragglers(const v1::Plan& plan) {
  // Only the plan's workers' figures, each looked up by id.
  std::vector<StageTimings> stages;
  for (const v1::StageAssignment& s : plan.stages()) {
    StageTimings& timings = stages.emplace_back();
    timings.layer_begin = s.layer_begin();
    timings.layer_end = s.layer_end();
    for (const StageWorker& worker : WorkersOf(s)) {
      std::optional<WorkerRecord> w = options_.membership->Find(worker.id);
      if (!w.has_value()) continue;
      const double measured = w->stats.compute_s_per_microbatch();
      if (w->alive && measured > 0) timings.workers.emplace_back(worker.id, measured);
    }
  }
  absl::MutexLock lock(&mu_);
  std::vector<Action> actions;
  for (const StragglerVerdict& slow : stragglers_.Check(stages, options_.clock->NowMs())) {
    options_.events->Add("straggler", NameOf(slow.worker_id), slow.reason);
    // A replica slower than its siblings is demoted to standby and not made
    // a replica again; a slow stage swaps its slowest worker for a standby.
    if (slow.demote) demoted_.insert(slow.worker_id);
    Action& action = actions.emplace_back();
    action.kind = slow.demote ? Action::Kind::kTakeOut : Action::Kind::kSwapWithStandby;
    action.worker_id = slow.worker_id;
    action.why = absl::StrCat("it straggles (", slow.reason, ")");
  }
  return actions;
}

std::optional<FaultResponder::Action> FaultResponder::CheckProgress(const v1::Plan& plan) {
  // Once the last step is committed the job is finishing (final stats,
  // checkpoints, DONE), not stalled: no step is owed.
  if (plan.job_done() || plan.stages_size() == 0) return std::nullopt;
  const ProgressTracker::Pace pace = options_.progress->pace();
  if (pace.any_done || pace.step >= options_.total_steps) return std::nullopt;
  const int64_t now = options_.clock->NowMs();
  const int64_t lease = options_.membership->lease_ms();
  // Once the epoch has made a step: two leases, or ten steps at the pace so
  // far (a slow model is not a stalled one). Before: the time a new plan
  // may take to restore state and open its links.
  const int64_t limit =
      pace.progress_in_epoch ? std::max<int64_t>(2 * lease, 10 * pace.step_interval_ms)
                             : std::max<int64_t>(10 * lease, kStartupGraceMs);
  const int64_t since = std::max(pace.last_progress_ms, pace.epoch_started_ms);
  if (now - since <= limit) return std::nullopt;
  absl::MutexLock lock(&mu_);
  if (PipelinesOf(plan) > 1) {
    bool others_move = false;
    std::optional<Action> pipeline = StalledPipelineLocked(plan, pace, now, limit, &others_move);
    if (others_move) return pipeline;
  }
  // Follow whom the plan's workers wait on (their heartbeats) to one that
  // is owed an answer and waits on nobody: the stall is there.
  std::map<std::string, std::string> waits_on;
  for (const v1::StageAssignment& stage : plan.stages()) {
    for (const StageWorker& w : WorkersOf(stage)) {
      std::optional<WorkerRecord> record = options_.membership->Find(w.id);
      if (!record.has_value() || !record->alive) continue;
      const v1::StageStats& stats = record->stats;
      if (!stats.waiting_on().empty() && stats.waiting_s() * 1000 >= lease &&
          StageOf(plan, stats.waiting_on()) != nullptr) {
        waits_on[w.id] = stats.waiting_on();
      }
    }
  }
  const std::string stalled_for = absl::StrFormat("%.1f s", (now - since) / 1000.0);
  options_.progress->MarkStallHandled(now);  // one action per stall period
  for (const auto& [waiter, on] : waits_on) {
    if (waits_on.count(on) > 0) continue;
    options_.events->Add("stalled", NameOf(on),
                         absl::StrCat("no step for ", stalled_for, "; ", NameOf(waiter),
                                      " has waited on ", NameOf(on), ", which waits on nobody"));
    return BrokenLinkLocked(waiter, on, plan.epoch(), "stalled");
  }
  // Nobody is owed anything, and nothing moves: stage 0 issues nothing.
  const std::string first = plan.stages(0).worker_id();
  options_.events->Add("stalled", NameOf(first),
                       absl::StrCat("no step for ", stalled_for,
                                    " and no stage is owed an answer: stage 0 issues nothing"));
  if (plan.stages_size() > 1) {
    return BrokenLinkLocked(plan.stages(1).worker_id(), first, plan.epoch(), "stalled");
  }
  Action action;
  action.worker_id = first;
  action.why = "it made no step";
  return action;
}

std::optional<FaultResponder::Action> FaultResponder::StalledPipelineLocked(
    const v1::Plan& plan, const ProgressTracker::Pace& pace, int64_t now, int64_t limit,
    bool* others_move) {
  int64_t latest = 0;
  for (const auto& [r, ms] : pace.pipeline_moved_ms) latest = std::max(latest, ms);
  *others_move = now - latest <= limit;
  if (!*others_move) return std::nullopt;  // none moves: the job is stalled
  // The job's step waits for the slowest pipeline, but the others move: a
  // pipeline that alone stands still for as long as a new plan may take to
  // start (a newcomer restoring its state over a thin link) is taken out
  // of the plan, and only it.
  const int64_t grace =
      std::max<int64_t>(10 * options_.membership->lease_ms(), kStartupGraceMs);
  for (const auto& [r, ms] : pace.pipeline_moved_ms) {
    if (now - ms <= std::max(limit, grace)) continue;
    const std::vector<StageWorker> first = WorkersOf(plan.stages(0), r);
    if (first.empty()) continue;
    options_.events->Add("stalled", NameOf(first[0].id),
                         absl::StrFormat("pipeline %d made no step for %.1f s while the "
                                         "others did: its stage 0 is taken out",
                                         r, (now - ms) / 1000.0));
    options_.progress->MarkStallHandled(now);  // one action per stall period
    Action action;
    action.worker_id = first[0].id;
    action.why = absl::StrCat("pipeline ", r, " stalled");
    return action;
  }
  return std::nullopt;
}

void FaultResponder::PlanChanged() {
  absl::MutexLock lock(&mu_);
  stragglers_.ResetPatience();  // figures of the old plan say nothing of the new
}

void FaultResponder::MarkTakenOut(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  taken_out_ms_[worker_id] = options_.clock->NowMs();
}

std::optional<std::string> FaultResponder::ExclusionOf(const std::string& worker_id) const {
  if (!options_.authenticated_callers) return std::nullopt;
  absl::MutexLock lock(&mu_);
  return link_faults_.ExclusionOf(worker_id, options_.clock->NowMs());
}

bool FaultResponder::EligibleStandby(const WorkerRecord& worker) const {
  if (ExclusionOf(worker.id).has_value()) return false;
  absl::MutexLock lock(&mu_);
  auto taken_out = taken_out_ms_.find(worker.id);
  // A worker taken out for a lost link may simply be dead (its lease has
  // not run out yet): it is a standby again once it has sent a heartbeat.
  return taken_out == taken_out_ms_.end() || worker.last_heartbeat_ms > taken_out->second;
}

bool FaultResponder::MayReplicate(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  if (demoted_.count(worker_id) > 0) return false;
  auto taken_out = taken_out_ms_.find(worker_id);
  return taken_out == taken_out_ms_.end() ||
         options_.clock->NowMs() - taken_out->second >= kReplicaCooldownMs;
}

bool FaultResponder::Demoted(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  return demoted_.count(worker_id) > 0;
}

}  // namespace geotrain
