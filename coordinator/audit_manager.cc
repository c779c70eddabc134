#include "coordinator/audit_manager.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace geotrain {
namespace {

// The key of pipeline r's stage-k computation in the draw: pipelines
// compute the same microbatch ids, and each is drawn on its own.
int DrawKey(int stage, int pipeline) { return stage + pipeline * 65536; }
// An update's key: the step stands where a microbatch id stands, and the
// key lies above every stage's (stages are never 32,000 deep).
int UpdateDrawKey(int stage, int pipeline) { return DrawKey(stage + 32768, pipeline); }
// The verifier choices' randomness: keys below any computation's of the
// pipeline (stages are never 65,000 deep).
int ChoiceKey(size_t attempt, int pipeline) {
  return DrawKey(-1 - static_cast<int>(attempt), pipeline);
}

// Pipeline r's worker of `stage`, or empty.
std::string WorkerOf(const v1::StageAssignment& stage, int pipeline) {
  if (pipeline == 0) return stage.worker_id();
  for (const v1::Replica& r : stage.replicas()) {
    if (r.pipeline() == pipeline) return r.worker_id();
  }
  return "";
}

// Whether `stage` routes its microbatches among replicas of one pipeline.
bool Routed(const v1::StageAssignment& stage) {
  for (const v1::Replica& r : stage.replicas()) {
    if (r.pipeline() == 0) return true;
  }
  return false;
}

}  // namespace

const char* AuditStateName(Audit::State state) {
  switch (state) {
    case Audit::State::kOpen: return "open";
    case Audit::State::kPassed: return "passed";
    case Audit::State::kConfirmed: return "confirmed mismatch";
    case Audit::State::kVerifierLied: return "verifier outvoted";
    case Audit::State::kUndecided: return "undecided";
    case Audit::State::kUnverifiable: return "unverifiable";
  }
  return "?";
}

AuditManager::AuditManager(SpotCheckDraw draw, AuditOptions options)
    : draw_(std::move(draw)), options_(options) {}

bool AuditManager::UpdateFits(const v1::StageAssignment& stage) const {
  if (options_.layer_parameters.empty() || options_.max_update_state_bytes == 0) return true;
  uint64_t parameters = 0;
  for (int layer = std::max(0, stage.layer_begin());
       layer < stage.layer_end() && layer < static_cast<int>(options_.layer_parameters.size());
       ++layer) {
    parameters += options_.layer_parameters[layer];
  }
  return parameters * options_.bytes_per_parameter <= options_.max_update_state_bytes;
}

std::optional<std::string> AuditManager::ChooseVerifierLocked(
    const Audit& audit, const v1::Plan& plan, const std::vector<std::string>& standbys) const {
  auto usable = [&](const std::string& id) {
    return !id.empty() && id != audit.audited && id != audit.upstream && id != audit.downstream &&
           std::find(audit.verifiers.begin(), audit.verifiers.end(), id) == audit.verifiers.end();
  };
  // The same stage in the other pipelines first: they hold its layers.
  std::vector<std::string> candidates;
  for (const v1::StageAssignment& s : plan.stages()) {
    if (s.stage() != audit.stage) continue;
    for (int r = 0; r < std::max(1, plan.pipelines()); ++r) {
      if (r != audit.pipeline && usable(WorkerOf(s, r))) candidates.push_back(WorkerOf(s, r));
    }
  }
  if (candidates.empty()) {
    for (const std::string& id : standbys) {
      if (usable(id)) candidates.push_back(id);
    }
  }
  if (candidates.empty()) return std::nullopt;
  const double u = draw_.Draw(audit.epoch, audit.microbatch,
                              ChoiceKey(audit.verifiers.size(), audit.pipeline));
  return candidates[std::min(candidates.size() - 1,
                             static_cast<size_t>(u * static_cast<double>(candidates.size())))];
}

void AuditManager::CloseLocked(Audit audit) {
  switch (audit.state) {
    case Audit::State::kPassed: ++counts_.passed; ++per_worker_[audit.audited].first; break;
    case Audit::State::kConfirmed: ++counts_.confirmed; ++per_worker_[audit.audited].second; break;
    case Audit::State::kVerifierLied: ++counts_.verifiers_caught; break;
    case Audit::State::kUndecided: ++counts_.undecided; break;
    case Audit::State::kUnverifiable: ++counts_.unverifiable; break;
    case Audit::State::kOpen: return;
  }
  open_.erase(audit.id);
  const uint64_t id = audit.id;
  closed_[id] = std::move(audit);
  while (closed_.size() > options_.max_closed_kept) closed_.erase(closed_.begin());
}

std::vector<Audit> AuditManager::OnStepCommitted(
    const v1::Plan& plan, int step, int job_microbatches, const std::vector<std::string>& standbys,
    const std::function<bool(const std::string&)>& is_suspect) {
  std::vector<Audit> opened;
  if (step < 1 || options_.fraction <= 0) return opened;
  absl::MutexLock lock(&mu_);
  const int pipelines = std::max(1, plan.pipelines());
  const int stages = plan.stages_size();
  for (int r = 0; r < pipelines; ++r) {
    int microbatches = job_microbatches;
    for (const v1::PipelineInfo& info : plan.pipeline_info()) {
      if (info.pipeline() == r && info.microbatches() > 0) microbatches = info.microbatches();
    }
    for (int k = std::max(0, options_.first_audited_stage); k < stages; ++k) {
      const v1::StageAssignment& stage = plan.stages(k);
      if (Routed(stage) || (k > 0 && Routed(plan.stages(k - 1))) ||
          (k + 1 < stages && Routed(plan.stages(k + 1)))) {
        continue;
      }
      Audit base;
      base.epoch = plan.epoch();
      base.pipeline = r;
      base.stage = stage.stage();
      base.step = step;
      base.audited = WorkerOf(stage, r);
      if (base.audited.empty()) continue;
      base.upstream = k > 0 ? WorkerOf(plan.stages(k - 1), r) : "";
      base.downstream = k + 1 < stages ? WorkerOf(plan.stages(k + 1), r) : "";
      base.kind = k + 1 < stages ? v1::MESSAGE_KIND_ACTIVATION : v1::MESSAGE_KIND_GRADIENT;
      if (k == 0 && k + 1 >= stages) continue;  // one stage: nothing crosses a link
      const double rate = std::min(
          1.0, options_.fraction * (is_suspect && is_suspect(base.audited) ? options_.suspect_boost
                                                                          : 1.0));
      const int updated = step - 1;  // the step whose update `step` computed with
      const bool tied = options_.tied_ends && (k == 0 || k + 1 == stages);
      if (options_.audit_updates && !tied && UpdateFits(stage) &&
          updated > plan.start_step() && updated >= 1 &&
          draw_.Draw(base.epoch, static_cast<uint64_t>(updated),
                     UpdateDrawKey(base.stage, r)) < rate) {
        ++counts_.drawn;
        if (open_.size() >= options_.max_open_audits) {
          ++counts_.dropped;
        } else {
          Audit audit = base;
          audit.id = next_id_++;
          audit.update = true;
          audit.step = updated;
          for (int j = 0; j < microbatches; ++j) {
            audit.microbatches.push_back(static_cast<uint64_t>(updated - 1) * microbatches + j);
          }
          audit.microbatch = audit.microbatches.front();
          audit.next_microbatch = static_cast<uint64_t>(updated) * microbatches;
          std::optional<std::string> verifier = ChooseVerifierLocked(audit, plan, standbys);
          if (!verifier.has_value()) {
            audit.state = Audit::State::kUndecided;
            CloseLocked(std::move(audit));
          } else {
            audit.verifiers.push_back(*verifier);
            open_[audit.id] = audit;
            opened.push_back(std::move(audit));
          }
        }
      }
      for (int j = 0; j < microbatches; ++j) {
        const uint64_t microbatch = static_cast<uint64_t>(step - 1) * microbatches + j;
        if (draw_.Draw(base.epoch, microbatch, DrawKey(base.stage, r)) >= rate) continue;
        ++counts_.drawn;
        if (open_.size() >= options_.max_open_audits) {
          ++counts_.dropped;
          continue;
        }
        Audit audit = base;
        audit.id = next_id_++;
        audit.microbatch = microbatch;
        std::optional<std::string> verifier = ChooseVerifierLocked(audit, plan, standbys);
        if (!verifier.has_value()) {
          audit.state = Audit::State::kUndecided;
          CloseLocked(std::move(audit));
          continue;
        }
        audit.verifiers.push_back(*verifier);
        open_[audit.id] = audit;
        opened.push_back(std::move(audit));
      }
    }
  }
  return opened;
}

absl::StatusOr<AuditDecision> AuditManager::OnVerdict(uint64_t id, const std::string& verifier,
                                                      bool passed, bool verifiable,
                                                      const std::string& summary,
                                                      const v1::Plan& plan,
                                                      const std::vector<std::string>& standbys) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(id);
  if (it == open_.end()) return absl::NotFoundError(absl::StrCat("no open audit ", id));
  Audit& audit = it->second;
  // Only the verifier asked last answers, once.
  if (audit.verifiers.size() != audit.passed.size() + audit.unverifiable_by.size() + 1 ||
      audit.verifiers.back() != verifier) {
    return absl::PermissionDeniedError(
        absl::StrCat(verifier, " was not asked for audit ", id, "'s next verdict"));
  }
  AuditDecision decision;
  audit.summaries.push_back(summary);
  if (verifiable) {
    audit.passed.push_back(passed);
    audit.passed_by.push_back(verifier);
  } else {
    audit.unverifiable_by.push_back(verifier);
  }
  auto close = [&](Audit::State state) {
    audit.state = state;
    decision.audit = audit;
    CloseLocked(std::move(audit));
    return decision;
  };
  auto ask_next = [&]() -> std::optional<std::string> {
    if (static_cast<int>(audit.verifiers.size()) >= options_.max_verifiers) return std::nullopt;
    return ChooseVerifierLocked(audit, plan, standbys);
  };
  // Can the bundle be recomputed? Every honest verifier answers the same
  // from the same evidence; where they disagree, the majority decides and
  // the minority lied.
  const size_t unverifiable = audit.unverifiable_by.size();
  const size_t verifiable_votes = audit.passed.size();
  if (unverifiable > 0) {
    if (unverifiable > verifiable_votes && (unverifiable >= 2 || verifiable_votes == 0)) {
      const bool settled = unverifiable >= 2;
      std::optional<std::string> next = settled ? std::nullopt : ask_next();
      if (next.has_value()) {
        audit.verifiers.push_back(*next);
        decision.ask = *next;
        decision.audit = audit;
        return decision;
      }
      decision.evict = audit.passed_by;  // it was not theirs to pass or fail
      decision.reason =
          decision.evict.empty()
              ? absl::StrCat("unverifiable: ", summary)
              : absl::StrCat("outvoted on audit ", id, " of ", audit.audited, ": ", unverifiable,
                             " verifiers found it unverifiable, ",
                             absl::StrJoin(decision.evict, ", "), " gave a verdict");
      return close(decision.evict.empty() ? Audit::State::kUnverifiable
                                          : Audit::State::kVerifierLied);
    }
    if (unverifiable == verifiable_votes) {  // one each: a third decides
      std::optional<std::string> next = ask_next();
      if (!next.has_value()) {
        decision.reason = absl::StrCat("audit ", id, " of ", audit.audited,
                                       " is undecided (verifiers disagree whether it can be "
                                       "recomputed, no verifier left)");
        return close(Audit::State::kUndecided);
      }
      audit.verifiers.push_back(*next);
      decision.ask = *next;
      decision.audit = audit;
      return decision;
    }
    // More verdicts than unverifiable: those who said unverifiable lied;
    // the verdicts go on as if they alone had been given.
    decision.evict = audit.unverifiable_by;
  }
  const int fails = static_cast<int>(std::count(audit.passed.begin(), audit.passed.end(), false));
  const int passes = static_cast<int>(audit.passed.size()) - fails;
  // Settled: the first verdict passes, or two verdicts agree on a mismatch,
  // or a majority has formed after a disagreement (or, after a verifier who
  // called it unverifiable was outvoted, the two verdicts both pass).
  const bool settled = (audit.passed.size() == 1 && passed) || fails >= 2 || passes >= 2;
  if (settled) {
    const std::vector<std::string> outvoted = decision.evict;
    if (fails >= 2) {
      decision.evict.push_back(audit.audited);
      // A verifier that passed what the majority found wrong lied too.
      for (size_t i = 0; i < audit.passed.size(); ++i) {
        if (audit.passed[i]) decision.evict.push_back(audit.passed_by[i]);
      }
      decision.reason = absl::StrCat(
          audit.audited, "'s ",
          audit.update ? absl::StrCat("update after step ", audit.step)
                       : absl::StrCat(audit.kind == v1::MESSAGE_KIND_ACTIVATION ? "activation"
                                                                                : "gradient",
                                      " of microbatch ", audit.microbatch),
          " (epoch ", audit.epoch, ", stage ", audit.stage, ") failed ", fails,
          " verifiers: ", absl::StrJoin(audit.summaries, " | "));
      return close(Audit::State::kConfirmed);
    }
    std::vector<std::string> minority = outvoted;
    for (size_t i = 0; i < audit.passed.size(); ++i) {
      if (!audit.passed[i]) minority.push_back(audit.passed_by[i]);
    }
    if (minority.empty()) return close(Audit::State::kPassed);
    decision.evict = minority;
    decision.reason = absl::StrCat("outvoted on audit ", id, " of ", audit.audited, ": ", passes,
                                   " verifiers passed it, ", absl::StrJoin(minority, ", "),
                                   " did not");
    return close(Audit::State::kVerifierLied);
  }
  // Not settled: another verifier, if one is left. (Verifiers already
  // outvoted on whether it can be recomputed are evicted only once it is
  // settled.)
  decision.evict.clear();
  std::optional<std::string> next = ask_next();
  if (!next.has_value()) {
    decision.reason = absl::StrCat("audit ", id, " of ", audit.audited, " is undecided (",
                                   passes, " passed, ", fails, " failed, no verifier left)");
    return close(Audit::State::kUndecided);
  }
  audit.verifiers.push_back(*next);
  decision.ask = *next;
  decision.audit = audit;
  return decision;
}

double UpdateSyncRate(const v1::JobSpec& job) {
  double rate = 0;
  if (job.has_outer()) {
    rate += 1.0 / (job.outer().inner_steps() > 0 ? job.outer().inner_steps() : 50);
  }
  if (job.replicas() > 1) {
    rate += 1.0 / (job.replica_sync_every() > 0 ? job.replica_sync_every() : 5);
  }
  return std::min(1.0, std::max(0.05, 1.5 * rate));
}

bool UnverifiableUpdatesUnexplained(int64_t audits, int64_t unverifiable, double rate) {
  if (audits < 8) return false;
  const double n = static_cast<double>(audits);
  const double p = std::clamp(rate, 0.0, 1.0);
  return static_cast<double>(unverifiable) > p * n + 4 * std::sqrt(n * p * (1 - p)) + 4;
}

bool AuditManager::Abandon(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(id);
  if (it == open_.end()) return false;
  Audit audit = it->second;
  audit.state = Audit::State::kUndecided;
  CloseLocked(std::move(audit));
  return true;
}

std::optional<Audit> AuditManager::Find(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  if (auto it = open_.find(id); it != open_.end()) return it->second;
  if (auto it = closed_.find(id); it != closed_.end()) return it->second;
  return std::nullopt;
}

std::vector<Audit> AuditManager::Open() const {
  absl::MutexLock lock(&mu_);
  std::vector<Audit> out;
  for (const auto& [id, audit] : open_) out.push_back(audit);
  return out;
}

AuditCounts AuditManager::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

std::map<std::string, std::pair<int64_t, int64_t>> AuditManager::PerWorker() const {
  absl::MutexLock lock(&mu_);
  return per_worker_;
}

}  // namespace geotrain
