#include "coordinator/plan_cost_model.h"

namespace geotrain {
namespace planner_internal {

// The workers of stage k (the primary first, then its replicas) and the
// share of the stage's microbatches each runs: the router sends by speed.
struct StageCrew {
  std::vector<int> workers;
  std::vector<double> shares;
};

// The workers in no stage, replica or pipeline of `plan`.
void FillSpares(const CostModel& model, PipelinePlan* plan) {
  std::vector<bool> used(model.workers(), false);
  for (const PlannedStageInfo& s : plan->stages) {
    used[s.worker] = true;
    for (int r : s.replicas) used[r] = true;
    for (int p : s.pipeline_workers) used[p] = true;
  }
  plan->spares.clear();
  for (int w = 0; w < model.workers(); ++w) {
    if (!used[w]) plan->spares.push_back(w);
  }
}

// Fills the figures of a plan whose workers, cuts, replicas and codecs are
// set. A replicated stage runs at its workers' combined pace plus its share
// of weight averaging (every worker sends the stage's weights once per
// replica_sync_every steps over the slowest link among them); a link into
// or out of one carries each pair's share of the microbatches, the pairs in
// parallel.
void Score(const CostModel& model, PipelinePlan* plan) {
  const PlannerInput& in = model.input();
  const int stages = static_cast<int>(plan->stages.size());
  double tau = 0;
  std::string bound;
  std::vector<StageCrew> crews(stages);
  // One microbatch's way through the pipeline and back (sync's fill and
  // drain, async's round trip): each stage's own worker and each link's
  // full rate, not the combined pace of a replicated stage (a replica
  // speeds up the stream, not one microbatch).
  double trip_s = 0;
  for (int k = 0; k < stages; ++k) {
    PlannedStageInfo& s = plan->stages[k];
    StageCrew& crew = crews[k];
    crew.workers.push_back(s.worker);
    crew.workers.insert(crew.workers.end(), s.replicas.begin(), s.replicas.end());
    double speed = 0;
    std::vector<double> own;
    for (int w : crew.workers) {
      double c = model.Compute(w, s.layer_begin, s.layer_end);
      if (k > 0) c += model.CodecWork(plan->links[k - 1].codec_index, s.layer_begin);
      if (k + 1 < stages) c += model.CodecWork(plan->links[k].codec_index, s.layer_end);
      own.push_back(c);
      speed += c > 0 ? 1 / c : 0;
    }
    for (double c : own) crew.shares.push_back(speed > 0 && c > 0 ? (1 / c) / speed : 1.0);
    trip_s += own[0];
    s.compute_s = speed > 0 ? 1 / speed : own[0];
    if (crew.workers.size() > 1) {
      double slowest = kInf;
      for (int a : crew.workers) {
        for (int b : crew.workers) {
          if (a != b) slowest = std::min(slowest, model.Rate(a, b));
        }
      }
      const double averaging_s = crew.workers.size() *
                                 model.ParameterBytes(s.layer_begin, s.layer_end) *
                                 in.replica_ratio * 8.0 / std::max(slowest, 1.0);
      s.compute_s += averaging_s / (std::max(1, in.replica_sync_every) *
                                    std::max(1, in.microbatches));
    }
    if (s.compute_s > tau) {
      tau = s.compute_s;
      bound = absl::StrCat("stage ", k, "'s compute on ", NameOf(in.workers[s.worker]),
                           s.replicas.empty() ? "" : absl::StrCat(" and ", s.replicas.size(),
                                                                  " replica(s)"));
    }
  }
  for (int k = 0; k + 1 < stages; ++k) {
    PlannedLinkInfo& link = plan->links[k];
    const int u = plan->stages[k].worker;
    const int v = plan->stages[k + 1].worker;
    const int cut = plan->stages[k].layer_end;
    const int u_links = LinksOfStage(k, stages);
    const int v_links = LinksOfStage(k + 1, stages);
    link.raw_bytes = model.CutBytes(cut);
    link.transfer_s = 0;
    for (size_t a = 0; a < crews[k].workers.size(); ++a) {
      for (size_t b = 0; b < crews[k + 1].workers.size(); ++b) {
        link.transfer_s = std::max(
            link.transfer_s, crews[k].shares[a] * crews[k + 1].shares[b] *
                                 model.Transfer(crews[k].workers[a], crews[k + 1].workers[b],
                                                link.codec_index, cut, u_links, v_links));
      }
    }
    link.rtt_s = model.Rtt(u, v);
    trip_s += 2 * model.Transfer(u, v, link.codec_index, cut, u_links, v_links) + link.rtt_s;
    if (link.transfer_s > tau) {
      tau = link.transfer_s;
      bound = absl::StrCat("link ", k, "->", k + 1, " (", NameOf(in.workers[u]), " -> ",
                           NameOf(in.workers[v]), ", ", model.codec(link.codec_index).name, ")");
    }
  }
  double sum_rtt = 0;
  for (const PlannedLinkInfo& link : plan->links) sum_rtt += link.rtt_s;
  plan->bottleneck_s = tau;
  plan->time_per_sample_s =
      model.Objective(tau, stages, sum_rtt, trip_s, &plan->in_flight, &plan->round_trip_s);
  plan->predicted_s_per_sample = plan->time_per_sample_s;
  if (in.schedule == PlannerSchedule::kSync) {
    const int m = std::max(1, in.microbatches);
    plan->predicted_s_per_sample =
        ((m - 1) * tau + trip_s) / (m * std::max(1, in.microbatch_size));
  }
  if (model.input().schedule == PlannerSchedule::kAsync && model.input().max_in_flight > 0 &&
      plan->time_per_sample_s * std::max(1, model.input().microbatch_size) > tau * (1 + 1e-12)) {
    bound = absl::StrCat("the in-flight cap (", model.input().max_in_flight,
                         ") against the round trip");
  }
  plan->bound = bound;
  FillSpares(model, plan);
}

// Under the async schedules with a cap W on the window the objective is
// max(T*, round trip / W): where the cap binds, cuts and codecs with a larger
// T* but a shorter round trip (a stronger codec: more codec work, shorter
// transfers) can beat the least T*. g(tau) = MinTrip(tau) / W does not grow
// with tau, so the best plan sits where tau meets g: bisection between the
// least feasible tau (`plan`'s T*, where g is above) and a tau where g is
// below, keeping the best plan scored on the way.
void CoverTheRoundTrip(const CostModel& model, Sweep* sweep, const std::vector<int>& order,
                       PipelinePlan* plan) {
  const PlannerInput& in = model.input();
  if (in.schedule != PlannerSchedule::kAsync || in.max_in_flight <= 0) return;
  const double window = in.max_in_flight;
  // Where the least-T* plan's own round trip fits the cap, it is optimal.
  if (plan->round_trip_s <= window * plan->bottleneck_s) return;
  // Scores the least round trip within tau, keeps it if better; returns g.
  auto trip_within = [&](double tau, double* bottleneck) {
    PipelinePlan trial;
    const double trip = sweep->MinTrip(order, tau, &trial);
    if (trip == kInf) return kInf;
    Score(model, &trial);
    if (bottleneck != nullptr) *bottleneck = trial.bottleneck_s;
    if (trial.time_per_sample_s < plan->time_per_sample_s * (1 - kStrictlyBetter)) {
      *plan = std::move(trial);
    }
    return trip / window;
  };
  double lo = plan->bottleneck_s;
  if (trip_within(lo, nullptr) <= lo) return;  // the cap does not bind at the least T*
  double hi = 0;
  if (trip_within(kInf, &hi) > hi) return;  // the least round trip of all binds
  for (int i = 0; i < 100 && hi - lo > 1e-7 * hi; ++i) {
    const double mid = lo + (hi - lo) / 2;
    if (trip_within(mid, nullptr) <= mid) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
}

// The least T* for a fixed order (bisection on tau over the sweep; each
// feasible tau is tightened to the plan's own T*), then, where a window cap
// binds, the least objective (CoverTheRoundTrip).
bool BestCuts(const CostModel& model, Sweep* sweep, const std::vector<int>& order,
              PipelinePlan* plan) {
  PipelinePlan candidate;
  if (!sweep->Feasible(order, kInf, &candidate)) return false;
  Score(model, &candidate);
  double hi = candidate.bottleneck_s;
  double lo = 0;
  for (int i = 0; i < 100 && hi - lo > 1e-7 * hi; ++i) {
    const double mid = lo + (hi - lo) / 2;
    PipelinePlan tighter;
    if (sweep->Feasible(order, mid, &tighter)) {
      Score(model, &tighter);
      hi = tighter.bottleneck_s;
      candidate = std::move(tighter);
    } else {
      lo = mid;
    }
  }
  *plan = std::move(candidate);
  CoverTheRoundTrip(model, sweep, order, plan);
  return true;
}

// Whether every worker of stage `s` holds its layers in memory.
bool StageFits(const CostModel& model, const PlannedStageInfo& s) {
  if (s.layer_end <= s.layer_begin) return false;
  const uint64_t need = model.MemoryOf(s.layer_begin, s.layer_end);
  auto fits = [&](int w) {
    const uint64_t memory = model.input().workers[w].memory_bytes;
    return memory == 0 || need <= memory;
  };
  if (!fits(s.worker)) return false;
  return std::all_of(s.replicas.begin(), s.replicas.end(), fits);
}

// Moves cuts one layer at a time while that lowers the objective (a stage
// that gained a replica can take layers from its neighbours). Codecs stay.
void ImproveCuts(const CostModel& model, PipelinePlan* plan) {
  const int stages = static_cast<int>(plan->stages.size());
  for (int round = 0; round < 4 * model.layers(); ++round) {
    PipelinePlan best;
    bool found = false;
    for (int k = 0; k + 1 < stages; ++k) {
      for (int delta : {-1, 1}) {
        PipelinePlan trial = *plan;
        trial.stages[k].layer_end += delta;
        trial.stages[k + 1].layer_begin += delta;
        if (!StageFits(model, trial.stages[k]) || !StageFits(model, trial.stages[k + 1])) continue;
        Score(model, &trial);
        const double bar = found ? best.time_per_sample_s : plan->time_per_sample_s;
        if (trial.time_per_sample_s < bar * (1 - kStrictlyBetter)) {
          best = std::move(trial);
          found = true;
        }
      }
    }
    if (!found) return;
    *plan = std::move(best);
  }
}

// Replicas, after the search has fixed the pipeline: while making a spare a
// replica of a stage in ReplicableStages with room (max_replicas per stage) and
// then moving cuts lowers the objective by more than 1%, the best such move
// is taken. Per stage the spare tried is the fastest on its layers that
// fits (ties: the lower index). Greedy: the pipeline is the search's (exact
// up to 8 workers); which spares replicate it is not searched exhaustively.
void AddReplicas(const CostModel& model, PipelinePlan* plan) {
  const PlannerInput& in = model.input();
  const int stages = static_cast<int>(plan->stages.size());
  if (in.max_replicas <= 1 || stages < 2) return;
  while (!plan->spares.empty()) {
    PipelinePlan best;
    bool found = false;
    // In ReplicableStages' order, so that a tie goes to a middle stage.
    for (int k : ReplicableStages(stages)) {
      const PlannedStageInfo& s = plan->stages[k];
      if (1 + static_cast<int>(s.replicas.size()) >= in.max_replicas) continue;
      int pick = -1;
      for (int spare : plan->spares) {
        if (!in.workers[spare].may_replicate) continue;
        PlannedStageInfo with = s;
        with.replicas = {spare};
        with.worker = spare;
        if (!StageFits(model, with)) continue;
        if (pick < 0 || model.Compute(spare, s.layer_begin, s.layer_end) <
                            model.Compute(pick, s.layer_begin, s.layer_end)) {
          pick = spare;
        }
      }
      if (pick < 0) continue;
      PipelinePlan trial = *plan;
      trial.stages[k].replicas.push_back(pick);
      Score(model, &trial);
      ImproveCuts(model, &trial);
      const double bar = found ? best.time_per_sample_s : plan->time_per_sample_s * 0.99;
      if (trial.time_per_sample_s < bar * (found ? 1 - kStrictlyBetter : 1)) {
        best = std::move(trial);
        found = true;
      }
    }
    if (!found) return;
    *plan = std::move(best);
  }
}

// The job's figures for R = plan->pipelines pipelines side by side
// (plan->stages[k].pipeline_workers set), given the slowest pipeline's time
// per sample (and prediction). A job step commits once every pipeline has
// made it, and no pipeline runs more than a round ahead, so the job moves
// at R times its slowest pipeline's samples/s; every outer_inner_steps steps
// each stage's replicas send their pseudo-gradients to the stage's reducer
// (its pipeline-0 worker) and take the mean back: R - 1 transfers of the
// stage's weights at outer_ratio through the reducer's port, or over the
// slowest replica pair where that is slower.
void ScoreOuterSync(const CostModel& model, double slowest_s, double slowest_predicted_s,
                    PipelinePlan* plan) {
  const PlannerInput& in = model.input();
  const int pipelines = std::max(1, plan->pipelines);
  double outer_s = 0;
  if (pipelines > 1) {
    for (const PlannedStageInfo& s : plan->stages) {
      double slowest_link = kInf;
      for (int p : s.pipeline_workers) {
        slowest_link = std::min(slowest_link, model.LinkRate(s.worker, p, 1, 1));
      }
      const double bytes = model.ParameterBytes(s.layer_begin, s.layer_end) * in.outer_ratio;
      outer_s = std::max(outer_s, bytes * (pipelines - 1) * 8 / std::max(slowest_link, 1.0));
    }
  }
  // Split (OuterOptimizer.split_batch), the R pipelines share the job's
  // batch: a round has R times fewer samples to spread the sync over.
  const double samples_per_round = static_cast<double>(std::max(1, in.outer_inner_steps)) *
                                   std::max(1, in.microbatches) *
                                   std::max(1, in.microbatch_size) *
                                   (in.outer_split_batch ? 1 : pipelines);
  plan->time_per_sample_s = slowest_s / pipelines + outer_s / samples_per_round;
  plan->predicted_s_per_sample = slowest_predicted_s / pipelines + outer_s / samples_per_round;
}

// Pipeline 0 is `plan` (its figures as Score left them), `more` the others
// at the same cuts and codecs: the job's figures (ScoreOuterSync) and spares.
void ScorePipelines(const CostModel& model, const std::vector<PipelinePlan>& more,
                    PipelinePlan* plan) {
  plan->pipelines = 1 + static_cast<int>(more.size());
  for (PlannedStageInfo& s : plan->stages) s.pipeline_workers.clear();
  double slowest = plan->time_per_sample_s;
  double slowest_predicted = plan->predicted_s_per_sample;
  for (const PipelinePlan& other : more) {
    slowest = std::max(slowest, other.time_per_sample_s);
    slowest_predicted = std::max(slowest_predicted, other.predicted_s_per_sample);
    for (size_t k = 0; k < plan->stages.size(); ++k) {
      plan->stages[k].pipeline_workers.push_back(other.stages[k].worker);
    }
  }
  ScoreOuterSync(model, slowest, slowest_predicted, plan);
  FillSpares(model, plan);
}

// Pipelines (job.outer: max_pipelines 0, as many as pay, or a cap), after
// the search has fixed pipeline 0: while a further pipeline of spares at
// pipeline 0's cuts and codecs lowers the job's predicted time per sample
// by more than 1%, the outer sync's traffic counted (ScorePipelines), it is
// added. Greedy: a new pipeline's stages choose in order of pipeline 0's
// compute, heaviest first, each the spare fastest on its layers that holds
// them and may replicate; links and ports are then scored as they fall.
void AddPipelines(const CostModel& model, PipelinePlan* plan) {
  const PlannerInput& in = model.input();
  if (in.max_pipelines == 1 || plan->stages.empty()) return;
  const int stages = static_cast<int>(plan->stages.size());
  std::vector<int> heaviest_first(stages);
  std::iota(heaviest_first.begin(), heaviest_first.end(), 0);
  std::stable_sort(heaviest_first.begin(), heaviest_first.end(), [&](int a, int b) {
    return plan->stages[a].compute_s > plan->stages[b].compute_s;
  });
  const PipelinePlan first = *plan;  // pipeline 0, as Score left it
  std::vector<PipelinePlan> more;
  PipelinePlan best = first;
  ScorePipelines(model, more, &best);
  while (in.max_pipelines <= 0 || 1 + static_cast<int>(more.size()) < in.max_pipelines) {
    std::vector<int> spares = best.spares;
    if (static_cast<int>(spares.size()) < stages) break;
    PipelinePlan next = first;
    for (PlannedStageInfo& s : next.stages) s.replicas.clear();
    bool filled = true;
    for (int k : heaviest_first) {
      PlannedStageInfo& s = next.stages[k];
      int pick = -1;
      for (int spare : spares) {
        // A worker barred from replicating (a demoted straggler, a replica
        // lost a moment ago) holds no stage's copy in another pipeline.
        if (!in.workers[spare].may_replicate) continue;
        PlannedStageInfo trial = s;
        trial.worker = spare;
        if (!StageFits(model, trial)) continue;
        if (pick < 0 || model.Compute(spare, s.layer_begin, s.layer_end) <
                            model.Compute(pick, s.layer_begin, s.layer_end)) {
          pick = spare;
        }
      }
      if (pick < 0) {
        filled = false;
        break;
      }
      s.worker = pick;
      spares.erase(std::find(spares.begin(), spares.end(), pick));
    }
    if (!filled) break;
    Score(model, &next);
    if (!std::isfinite(next.time_per_sample_s)) break;
    std::vector<PipelinePlan> trial_more = more;
    trial_more.push_back(next);
    PipelinePlan trial = first;
    ScorePipelines(model, trial_more, &trial);
    if (!(trial.time_per_sample_s < best.time_per_sample_s * 0.99)) break;
    more = std::move(trial_more);
    best = std::move(trial);
  }
  *plan = std::move(best);
}

absl::Status Validate(const PlannerInput& input) {
  if (input.layers.empty()) return absl::InvalidArgumentError("model has no layers");
  if (input.workers.empty()) return absl::FailedPreconditionError("no workers");
  const size_t n = input.workers.size();
  if (!input.links.empty() && input.links.size() != n * n) {
    return absl::InvalidArgumentError(
        absl::StrCat("link matrix has ", input.links.size(), " entries for ", n, " workers"));
  }
  if (!(input.default_link.rate_bps > 0)) {
    return absl::InvalidArgumentError("default link rate must be positive");
  }
  for (const CodecCost& c : input.codecs) {
    if (!(c.ratio > 0) || !(c.seconds_per_byte >= 0)) {
      return absl::InvalidArgumentError(absl::StrCat("codec ", c.name, ": bad ratio or cost"));
    }
  }
  return absl::OkStatus();
}

int StageLimit(const PlannerInput& input) {
  int limit = std::min<int>(input.workers.size(), input.layers.size());
  if (input.max_stages > 0) limit = std::min(limit, input.max_stages);
  return limit;
}

absl::Status NoFit(const CostModel& model, int stages) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "the model's ", model.layers(), " layers (", model.MemoryOf(0, model.layers()) >> 20,
      " MiB to train) do not fit on up to ", stages, " workers' memory"));
}

// Reasons, after the search: what each worker brings where it is.
void Explain(const CostModel& model, PipelinePlan* plan, const std::string& how) {
  const PlannerInput& in = model.input();
  for (size_t k = 0; k < plan->stages.size(); ++k) {
    PlannedStageInfo& s = plan->stages[k];
    const PlannerWorkerInfo& w = in.workers[s.worker];
    std::string why = absl::StrFormat("%d layers, %.1f%% of T*", s.layer_end - s.layer_begin,
                                      100 * s.compute_s / std::max(plan->bottleneck_s, 1e-300));
    if (k > 0) {
      const int prev = plan->stages[k - 1].worker;
      // Among the other workers, how many have a faster link from the
      // previous stage's worker.
      int faster = 0;
      for (int v = 0; v < model.workers(); ++v) {
        if (v != prev && v != s.worker && model.Rate(prev, v) > model.Rate(prev, s.worker)) {
          ++faster;
        }
      }
      absl::StrAppendFormat(&why, "; from %s at %.0f Mb/s, %.1f ms RTT", NameOf(in.workers[prev]),
                            model.Rate(prev, s.worker) / 1e6, 1e3 * model.Rtt(prev, s.worker));
      if (faster == 0) absl::StrAppend(&why, " (its fastest link)");
      const int stages = static_cast<int>(plan->stages.size());
      const double shared = model.LinkRate(prev, s.worker, LinksOfStage(static_cast<int>(k) - 1, stages),
                                           LinksOfStage(static_cast<int>(k), stages));
      if (shared < model.Rate(prev, s.worker) * (1 - 1e-9)) {
        absl::StrAppendFormat(&why, ", %.0f Mb/s of it as the ports' links share them",
                              shared / 1e6);
      }
    }
    if (!w.reachable) absl::StrAppend(&why, "; not reachable: its neighbours dial or relay");
    s.why = absl::StrCat(how, ": ", why);
  }
}

}  // namespace planner_internal
}  // namespace geotrain
