#include "coordinator/network_planner.h"

#include <algorithm>
#include <set>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "coordinator/plan_cost_model.h"
#include "coordinator/planner.h"

namespace geotrain {

LinkEstimate PlannerInput::Link(int from, int to) const {
  const size_t n = workers.size();
  if (links.size() == n * n) {
    // A link carries both directions on one connection: a pair measured one
    // way only is taken as measured both ways.
    LinkEstimate link = links[static_cast<size_t>(from) * n + to];
    const LinkEstimate& reverse = links[static_cast<size_t>(to) * n + from];
    if (link.rate_bps <= 0) link.rate_bps = reverse.rate_bps;
    if (link.rtt_s <= 0) link.rtt_s = reverse.rtt_s;
    if (link.rate_bps > 0) {
      if (link.rtt_s <= 0) link.rtt_s = default_link.rtt_s;
      return link;
    }
  }
  return default_link;
}

std::vector<int> ReplicableStages(int stages) {
  std::vector<int> order;
  for (int k = 1; k + 1 < stages; ++k) order.push_back(k);
  if (stages > 1) order.push_back(0);
  return order;
}

namespace {

using planner_internal::AddPipelines;
using planner_internal::AddReplicas;
using planner_internal::BestCuts;
using planner_internal::CostModel;
using planner_internal::CoverTheRoundTrip;
using planner_internal::Explain;
using planner_internal::FillSpares;
using planner_internal::ImproveCuts;
using planner_internal::LinksOfStage;
using planner_internal::NameOf;
using planner_internal::NoFit;
using planner_internal::Score;
using planner_internal::ScoreOuterSync;
using planner_internal::ScorePipelines;
using planner_internal::StageFits;
using planner_internal::StageLimit;
using planner_internal::Sweep;
using planner_internal::Validate;
using planner_internal::kInf;
using planner_internal::kStrictlyBetter;

class JoinOrderPlanner : public Planner {
 public:
  std::string name() const override { return "join-order"; }

  absl::StatusOr<PipelinePlan> Plan(const PlannerInput& input) const override {
    if (absl::Status valid = Validate(input); !valid.ok()) return valid;
    std::vector<LayerProfile> layers;
    for (const PlannerLayer& l : input.layers) {
      LayerProfile p;
      p.flops_per_sample = l.flops_per_sample;
      p.training_bytes = l.training_bytes;
      layers.push_back(p);
    }
    const int n = static_cast<int>(input.workers.size());
    const int num_layers = static_cast<int>(input.layers.size());
    // Pipelines: P stages each (max_stages, else one per worker up to the
    // layers), as many full ones as the workers fill.
    const int stages = std::min(num_layers, input.max_stages > 0 ? input.max_stages : n);
    int pipelines = 1;
    if (input.max_pipelines != 1 && stages > 0) {
      pipelines = std::max(1, n / stages);
      if (input.max_pipelines > 0) pipelines = std::min(pipelines, input.max_pipelines);
    }
    // The fastest R x P workers in join order; pipeline r is the r-th run
    // of P of them.
    std::vector<int> chosen(n);
    std::iota(chosen.begin(), chosen.end(), 0);
    std::stable_sort(chosen.begin(), chosen.end(), [&](int a, int b) {
      return input.workers[a].gflops > input.workers[b].gflops;
    });
    if (pipelines > 1) {
      chosen.resize(static_cast<size_t>(pipelines) * stages);
      std::sort(chosen.begin(), chosen.end());
    }
    // One cut for every pipeline: position k's speed and memory are the
    // least of the pipelines' workers there.
    std::vector<PlannerWorker> workers;
    if (pipelines > 1) {
      for (int k = 0; k < stages; ++k) {
        PlannerWorker position{std::to_string(k), 1e300, UINT64_MAX};
        for (int r = 0; r < pipelines; ++r) {
          const PlannerWorkerInfo& w = input.workers[chosen[r * stages + k]];
          position.gflops = std::min(position.gflops, w.gflops);
          position.memory_bytes = std::min(position.memory_bytes, w.memory_bytes);
        }
        workers.push_back(position);
      }
    } else {
      for (const PlannerWorkerInfo& w : input.workers) {
        workers.push_back({w.id, w.gflops, w.memory_bytes});
      }
    }
    absl::StatusOr<std::vector<StageRange>> ranges =
        PlanStages(layers, workers, pipelines > 1 ? stages : input.max_stages);
    if (!ranges.ok()) return ranges.status();
    PipelinePlan plan;
    plan.pipelines = pipelines;
    for (size_t k = 0; k < ranges->size(); ++k) {
      const StageRange& r = (*ranges)[k];
      PlannedStageInfo s;
      if (pipelines > 1) {
        s.worker = chosen[k];
        for (int p = 1; p < pipelines; ++p) s.pipeline_workers.push_back(chosen[p * stages + k]);
      } else {
        for (size_t w = 0; w < input.workers.size(); ++w) {
          if (input.workers[w].id == r.worker_id) s.worker = static_cast<int>(w);
        }
      }
      s.layer_begin = r.layer_begin;
      s.layer_end = r.layer_end;
      plan.stages.push_back(s);
    }
    plan.links.assign(plan.stages.size() - 1, {});
    for (PlannedLinkInfo& link : plan.links) link.codec_index = 0;
    CostModel model(input);
    Score(model, &plan);
    // Pipeline 0's figures stand for each pipeline's.
    if (pipelines > 1) {
      ScoreOuterSync(model, plan.time_per_sample_s, plan.predicted_s_per_sample, &plan);
    }
    plan.planner = name();
    Explain(model, &plan, pipelines > 1 ? absl::StrCat("join order, ", pipelines,
                                                       " pipelines, cuts by compute")
                                        : std::string("join order, cuts by compute"));
    return plan;
  }
};

class NetworkPlanner : public Planner {
 public:
  explicit NetworkPlanner(NetworkPlannerOptions options) : options_(options) {}
  std::string name() const override { return "network"; }

  absl::StatusOr<PipelinePlan> Plan(const PlannerInput& input) const override {
    if (absl::Status valid = Validate(input); !valid.ok()) return valid;
    CostModel model(input);
    // One wall-clock budget for every search below (time_budget).
    const absl::Time deadline = options_.time_budget > absl::ZeroDuration()
                                    ? absl::Now() + options_.time_budget
                                    : absl::InfiniteFuture();
    std::string how;
    // Narrower windows may be scored after it (staleness_cost): the widest
    // one's searches take half of the budget, the rest is theirs.
    const bool windows_follow =
        input.schedule == PlannerSchedule::kAsync && input.staleness_cost > 0;
    const absl::Time widest_deadline =
        windows_follow && deadline != absl::InfiniteFuture()
            ? absl::Now() + (deadline - absl::Now()) / 2
            : deadline;
    std::optional<PipelinePlan> best = PlanForWindow(input, &how, widest_deadline);
    if (!best.has_value()) return NoFit(model, StageLimit(input));
    // Goodput: under async-stash each microbatch in flight beyond one per
    // stage is one more weight version of staleness in stage 0's gradients,
    // which costs loss per sample (PlannerInput::staleness_cost). The
    // window that covers the round trip maximises samples/s; a narrower
    // one (a cap, with cuts and codecs for it) wins where the samples/s it
    // gives up cost less than the staleness it saves.
    if (input.schedule == PlannerSchedule::kAsync && input.staleness_cost > 0) {
      const int widest = best->in_flight;
      double best_cost = GoodputSecondsPerSample(input, *best);
      for (int cap = 1; cap < widest && cap <= kMostWindowsTried; ++cap) {
        PlannerInput capped = input;
        capped.max_in_flight = cap;  // below widest, so within input's cap
        std::string capped_how;
        const int windows_left = std::min(widest - 1, kMostWindowsTried) - cap + 1;
        const absl::Time window_deadline =
            deadline == absl::InfiniteFuture()
                ? deadline
                : absl::Now() + (deadline - absl::Now()) / std::max(1, windows_left);
        std::optional<PipelinePlan> narrower =
            PlanForWindow(capped, &capped_how, window_deadline);
        // Workers run at least one microbatch in flight per stage.
        if (!narrower.has_value() ||
            narrower->in_flight < static_cast<int>(narrower->stages.size())) {
          continue;
        }
        const double cost = GoodputSecondsPerSample(input, *narrower);
        if (cost < best_cost * (1 - kStrictlyBetter)) {
          best_cost = cost;
          best = std::move(narrower);
          how = absl::StrCat(capped_how, "; W ", best->in_flight, " of ", widest,
                             " that covers the round trip: its samples/s over the staleness "
                             "cost is the best");
          if (best->in_flight == cap) {
            best->bound = absl::StrCat("the window (", best->in_flight,
                                       "): a wider one costs more in staleness than it gains");
          }
        }
      }
      // Each cap's search is exact in samples/s, not in goodput.
      if (best->in_flight < widest) best->exact = false;
    }
    best->planner = name();
    Explain(model, &*best, how);
    return *std::move(best);
  }

 private:
  // How many narrower windows Plan() scores against the widest.
  static constexpr int kMostWindowsTried = 8;

  // The best plan for `input` by samples/s (its window the one that covers
  // the round trip, within input.max_in_flight); `how` says how it was found.
  std::optional<PipelinePlan> PlanForWindow(const PlannerInput& input, std::string* how,
                                            absl::Time deadline) const {
    CostModel model(input);
    const bool exhaustive = model.workers() <= options_.exhaustive_max_workers;
    const int caps = input.max_pipelines == 1 ? 0 : StageLimit(input) - 1;
    // Each search has an equal share of the time left.
    auto share = [&deadline](int searches_left) {
      if (deadline == absl::InfiniteFuture()) return deadline;
      return absl::Now() + (deadline - absl::Now()) / std::max(1, searches_left);
    };
    std::optional<PipelinePlan> best = Search(input, exhaustive, share(caps + 1));
    if (!best.has_value()) return std::nullopt;
    *how = exhaustive ? "optimal" : "searched";
    if (input.max_pipelines == 1) {
      AddReplicas(model, &*best);
    } else {
      // R pipelines of at most P stages: pipeline 0 searched under each cap
      // P that leaves room for a second, the others filled from its spares
      // (AddPipelines); the best over the caps. Pipelines replace replicas
      // within one: a stage's copies sync by the outer step.
      AddPipelines(model, &*best);
      for (int cap = StageLimit(input) - 1; cap >= 1; --cap) {
        if (model.workers() / cap < 2) continue;
        PlannerInput capped = input;
        capped.max_stages = cap;
        std::optional<PipelinePlan> pipelines = Search(capped, exhaustive, share(cap));
        if (!pipelines.has_value()) continue;
        AddPipelines(model, &*pipelines);
        if (pipelines->time_per_sample_s < best->time_per_sample_s * (1 - kStrictlyBetter)) {
          best = std::move(pipelines);
        }
      }
      if (best->pipelines > 1) {
        absl::StrAppend(how, " pipeline 0; ", best->pipelines,
                        " pipelines at its cuts, the others of the fastest spares");
      }
    }
    best->exact = exhaustive && best->pipelines == 1;  // R is chosen greedily
    return best;
  }

  struct Best {
    double objective = kInf;
    std::vector<int> order;
    PipelinePlan plan;
    int evaluations = 0;
  };

  // The best single pipeline for `input` (its max_stages included);
  // nothing when none fits.
  // The local search stops at `deadline` (the exhaustive one never does).
  std::optional<PipelinePlan> Search(const PlannerInput& input, bool exhaustive,
                                     absl::Time deadline) const {
    CostModel model(input);
    Sweep sweep(model);
    Best best;
    Construct(model, &sweep, &best);
    if (exhaustive) {
      Exhaustive(model, &sweep, &best);
    } else {
      LocalSearch(model, &sweep, &best, deadline);
    }
    if (best.order.empty()) return std::nullopt;
    return std::move(best.plan);
  }

  // How many stages and links sit at T*: fewer is better among plans with
  // the same T*, so a search can cross a plateau where two slow stages tie
  // (removing one alone does not lower T*; removing both does).
  static int Critical(const PipelinePlan& plan) {
    int critical = 0;
    const double at = plan.bottleneck_s * (1 - 1e-6);
    for (const PlannedStageInfo& s : plan.stages) critical += s.compute_s >= at;
    for (const PlannedLinkInfo& l : plan.links) critical += l.transfer_s >= at;
    return critical;
  }

  // Scores `order` exactly if it might beat the incumbent; keeps it if it
  // does. With `ties`, an equal objective with fewer critical stages and
  // links also counts as better.
  static bool Offer(const CostModel& model, Sweep* sweep, const std::vector<int>& order,
                    Best* best, bool ties = false) {
    ++best->evaluations;
    double tau = model.TauBound(best->objective, static_cast<int>(order.size()),
                                model.SumRtt(order));
    if (ties && std::isfinite(tau)) tau /= 1 - kStrictlyBetter;
    if (tau <= 0 || !sweep->Feasible(order, tau, nullptr)) return false;
    PipelinePlan plan;
    if (!BestCuts(model, sweep, order, &plan)) return false;
    const bool better = plan.time_per_sample_s < best->objective * (1 - kStrictlyBetter);
    const bool tie_won = ties && !better &&
                         plan.time_per_sample_s <= best->objective * (1 + kStrictlyBetter) &&
                         Critical(plan) < Critical(best->plan);
    if (!better && !tie_won) return false;
    best->objective = plan.time_per_sample_s;
    best->order = order;
    best->plan = std::move(plan);
    return true;
  }

  // A pair's cost for chaining: the link time at a typical cut with the
  // cheapest codec that keeps up with it, plus its share of latency.
  static double PairCost(const CostModel& model, int u, int v) {
    int typical = model.layers() / 2;
    if (typical == 0) return model.Rtt(u, v);
    double best = kInf;
    for (int c = 0; c < model.codecs(); ++c) {
      // Middle stages at both ends: two links share each access link.
      best = std::min(best, std::max(model.Transfer(u, v, c, typical, 2, 2),
                                     model.CodecWork(c, typical)));
    }
    const PlannerInput& in = model.input();
    const double latency_weight =
        in.schedule == PlannerSchedule::kSync ? 1.0 / std::max(1, in.microbatches) : 0.05;
    return best + latency_weight * model.Rtt(u, v);
  }

  static double Speed(const CostModel& model, int w) {
    return 1.0 / std::max(model.Compute(w, 0, model.layers()), 1e-300);
  }

  // Greedy nearest-neighbour chain through `members` from `first`, at most
  // `limit` long.
  static std::vector<int> Chain(const CostModel& model, std::vector<int> members, int first,
                                int limit) {
    std::vector<int> order{first};
    members.erase(std::find(members.begin(), members.end(), first));
    while (!members.empty() && static_cast<int>(order.size()) < limit) {
      auto next = std::min_element(members.begin(), members.end(), [&](int a, int b) {
        const double ca = PairCost(model, order.back(), a);
        const double cb = PairCost(model, order.back(), b);
        if (ca != cb) return ca < cb;
        return Speed(model, a) > Speed(model, b);
      });
      order.push_back(*next);
      members.erase(next);
    }
    return order;
  }

  // Starting points: today's order; chains through everyone from the
  // fastest workers and from the ends of the network; chains inside each
  // group of workers that are close to each other (a region).
  void Construct(const CostModel& model, Sweep* sweep, Best* best) const {
    const int n = model.workers();
    const int limit = StageLimit(model.input());
    std::vector<int> all(n);
    std::iota(all.begin(), all.end(), 0);
    std::vector<int> by_speed = all;
    std::stable_sort(by_speed.begin(), by_speed.end(),
                     [&](int a, int b) { return Speed(model, a) > Speed(model, b); });
    {
      std::vector<int> join(by_speed.begin(), by_speed.begin() + limit);
      std::sort(join.begin(), join.end());
      Offer(model, sweep, join, best);
      std::vector<int> fastest(by_speed.begin(), by_speed.begin() + limit);
      Offer(model, sweep, fastest, best);
    }
    std::vector<int> starts(by_speed.begin(), by_speed.begin() + std::min(n, 4));
    // The worker farthest from the rest is a natural end of a path.
    std::vector<double> spread(n, 0);
    for (int u = 0; u < n; ++u) {
      for (int v = 0; v < n; ++v) {
        if (u != v) spread[u] += PairCost(model, u, v);
      }
    }
    std::vector<int> by_spread = all;
    std::stable_sort(by_spread.begin(), by_spread.end(),
                     [&](int a, int b) { return spread[a] > spread[b]; });
    for (int i = 0; i < std::min(n, 4); ++i) starts.push_back(by_spread[i]);
    for (int first : starts) {
      const std::vector<int> chain = Chain(model, all, first, limit);
      for (size_t len = 1; len <= chain.size(); len = len < 4 ? len + 1 : len * 2) {
        Offer(model, sweep, std::vector<int>(chain.begin(), chain.begin() + len), best);
      }
      Offer(model, sweep, chain, best);
    }
    // The fastest quarter, half, three quarters: slow workers are worth a
    // stage only where the fast ones run out.
    for (int quarter = 1; quarter < 4; ++quarter) {
      const int count = std::max(1, n * quarter / 4);
      std::vector<int> members(by_speed.begin(), by_speed.begin() + count);
      Offer(model, sweep, Chain(model, members, members.front(), limit), best);
    }
    // Regions: single-linkage groups of pairs whose cost is within 3x of
    // the closest pair's.
    double closest = kInf;
    for (int u = 0; u < n; ++u) {
      for (int v = 0; v < n; ++v) {
        if (u != v) closest = std::min(closest, PairCost(model, u, v));
      }
    }
    std::vector<int> group(all);
    std::function<int(int)> root = [&](int x) { return group[x] == x ? x : group[x] = root(group[x]); };
    for (int u = 0; u < n; ++u) {
      for (int v = 0; v < n; ++v) {
        if (u != v && PairCost(model, u, v) <= 3 * closest + 1e-12) group[root(u)] = root(v);
      }
    }
    std::map<int, std::vector<int>> regions;
    for (int w : by_speed) regions[root(w)].push_back(w);
    if (regions.size() > 1) {
      for (const auto& [unused, members] : regions) {
        Offer(model, sweep, Chain(model, members, members.front(), limit), best);
      }
    }
  }

  // Every order of every subset, depth first, pruned by the incumbent: a
  // prefix whose stages cannot all stay under the bound any completion
  // would need is not extended.
  void Exhaustive(const CostModel& model, Sweep* sweep, Best* best) const {
    const int n = model.workers();
    const int limit = StageLimit(model.input());
    std::vector<int> prefix;
    std::vector<bool> used(n, false);
    // Per depth: the stage's possible starts and ends.
    std::vector<std::vector<double>> starts(limit + 1), ends(limit + 1);
    std::function<void(double)> visit = [&](double sum_rtt) {
      const int k = static_cast<int>(prefix.size());
      const int w = prefix.back();
      double tau = model.TauBound(best->objective, k, sum_rtt);
      if (tau <= 0) return;
      sweep->StageEnds(w, starts[k - 1], tau, &ends[k - 1], nullptr);
      if (ends[k - 1][model.layers()] < kInf) {
        Offer(model, sweep, prefix, best);
        tau = model.TauBound(best->objective, k, sum_rtt);
      }
      if (k == limit) return;
      for (int v = 0; v < n; ++v) {
        if (used[v]) continue;
        // v's own outgoing link is not chosen yet: one link (its least)
        // keeps the bound optimistic; Offer scores the order exactly.
        if (!sweep->NextStarts(w, v, LinksOfStage(k - 1, k + 1), 1, ends[k - 1], tau, &starts[k],
                               nullptr)) {
          continue;
        }
        used[v] = true;
        prefix.push_back(v);
        visit(sum_rtt + model.Rtt(w, v));
        prefix.pop_back();
        used[v] = false;
      }
    };
    for (int w = 0; w < n; ++w) {
      starts[0].assign(model.layers() + 1, kInf);
      starts[0][0] = 0;
      used[w] = true;
      prefix = {w};
      visit(0);
      used[w] = false;
    }
  }

  // Moves on the best order (swap, reverse a segment, replace by, insert or
  // remove a worker), each kept if it lowers the objective. Seeded, so the
  // same inputs give the same plan.
  void LocalSearch(const CostModel& model, Sweep* sweep, Best* best, absl::Time deadline) const {
    if (best->order.empty()) return;
    const int n = model.workers();
    const int limit = StageLimit(model.input());
    const double work_per_sweep =
        static_cast<double>(limit) * model.layers() * model.codecs() + 1;
    const int64_t budget =
        sweep->sweeps() + std::clamp<int64_t>(static_cast<int64_t>(options_.search_work /
                                                                   work_per_sweep),
                                              options_.min_search_evaluations,
                                              options_.max_search_evaluations);
    std::mt19937 random(0x9e3779b9u);
    auto uniform = [&](int bound) {
      return static_cast<int>(std::uniform_int_distribution<int>(0, bound - 1)(random));
    };
    for (int64_t moves = 0; sweep->sweeps() < budget; ++moves) {
      if (moves % 16 == 15 && absl::Now() > deadline) break;
      std::vector<int> order = best->order;
      const int p = static_cast<int>(order.size());
      std::vector<int> unused;
      {
        std::vector<bool> in(n, false);
        for (int w : order) in[w] = true;
        for (int w = 0; w < n; ++w) {
          if (!in[w]) unused.push_back(w);
        }
      }
      // Stages at T*: the moves aimed at them change what binds.
      std::vector<int> critical;
      for (int k = 0; k < p; ++k) {
        if (best->plan.stages[k].compute_s >= best->plan.bottleneck_s * (1 - 1e-6)) {
          critical.push_back(k);
        }
      }
      switch (uniform(7)) {
        case 0:  // swap two stages' workers
          if (p < 2) continue;
          std::swap(order[uniform(p)], order[uniform(p)]);
          break;
        case 1: {  // reverse a segment (2-opt)
          if (p < 2) continue;
          int a = uniform(p), b = uniform(p);
          if (a > b) std::swap(a, b);
          std::reverse(order.begin() + a, order.begin() + b + 1);
          break;
        }
        case 2:  // a spare takes a stage
          if (unused.empty()) continue;
          order[uniform(p)] = unused[uniform(static_cast<int>(unused.size()))];
          break;
        case 3:  // a spare joins
          if (unused.empty() || p >= limit) continue;
          order.insert(order.begin() + uniform(p + 1),
                       unused[uniform(static_cast<int>(unused.size()))]);
          break;
        case 4:  // a stage leaves
          if (p < 2) continue;
          order.erase(order.begin() + uniform(p));
          break;
        case 5:  // a critical stage's worker leaves
          if (p < 2 || critical.empty()) continue;
          order.erase(order.begin() + critical[uniform(static_cast<int>(critical.size()))]);
          break;
        default: {  // the fastest spare takes a critical stage
          if (unused.empty() || critical.empty()) continue;
          const int fastest = *std::max_element(unused.begin(), unused.end(), [&](int a, int b) {
            return Speed(model, a) < Speed(model, b);
          });
          order[critical[uniform(static_cast<int>(critical.size()))]] = fastest;
          break;
        }
      }
      if (order == best->order) continue;
      Offer(model, sweep, order, best, /*ties=*/true);
    }
  }

  NetworkPlannerOptions options_;
};
}  // namespace

std::unique_ptr<Planner> MakeJoinOrderPlanner() { return std::make_unique<JoinOrderPlanner>(); }

std::unique_ptr<Planner> MakeNetworkPlanner(NetworkPlannerOptions options) {
  return std::make_unique<NetworkPlanner>(options);
}

absl::StatusOr<PipelinePlan> PlanForOrder(const PlannerInput& input,
                                          const std::vector<int>& order) {
  if (absl::Status valid = Validate(input); !valid.ok()) return valid;
  for (int w : order) {
    if (w < 0 || w >= static_cast<int>(input.workers.size())) {
      return absl::InvalidArgumentError(absl::StrCat("no worker ", w));
    }
  }
  CostModel model(input);
  Sweep sweep(model);
  PipelinePlan plan;
  if (!BestCuts(model, &sweep, order, &plan)) return NoFit(model, order.size());
  Explain(model, &plan, "given order");
  return plan;
}

absl::Status ScorePlan(const PlannerInput& input, PipelinePlan* plan) {
  if (absl::Status valid = Validate(input); !valid.ok()) return valid;
  CostModel model(input);
  const int layers = model.layers();
  int expected_begin = 0;
  for (const PlannedStageInfo& s : plan->stages) {
    if (s.worker < 0 || s.worker >= model.workers() || s.layer_begin != expected_begin ||
        s.layer_end <= s.layer_begin || s.layer_end > layers) {
      return absl::InvalidArgumentError("stages do not cover the layers in order");
    }
    for (int r : s.replicas) {
      if (r < 0 || r >= model.workers()) return absl::InvalidArgumentError("no such replica");
    }
    if (static_cast<int>(s.pipeline_workers.size()) != std::max(1, plan->pipelines) - 1) {
      return absl::InvalidArgumentError("a stage lacks a worker in some pipeline");
    }
    for (int p : s.pipeline_workers) {
      if (p < 0 || p >= model.workers()) return absl::InvalidArgumentError("no such worker");
    }
    expected_begin = s.layer_end;
  }
  if (expected_begin != layers) return absl::InvalidArgumentError("stages end before the last layer");
  plan->links.resize(plan->stages.size() - 1);
  for (PlannedLinkInfo& link : plan->links) {
    if (link.codec_index < 0 || link.codec_index >= model.codecs()) link.codec_index = 0;
  }
  // With pipelines, each is scored at the same cuts and codecs, and the job
  // as the planner scores R of them (ScorePipelines): the slowest one's
  // pace times R, with the outer sync's traffic.
  std::vector<PipelinePlan> more;
  for (int p = 1; p < plan->pipelines; ++p) {
    PipelinePlan other = *plan;
    other.pipelines = 1;
    for (size_t k = 0; k < other.stages.size(); ++k) {
      other.stages[k].worker = plan->stages[k].pipeline_workers[p - 1];
      other.stages[k].replicas.clear();
      other.stages[k].pipeline_workers.clear();
    }
    Score(model, &other);
    more.push_back(std::move(other));
  }
  const int pipelines = std::max(1, plan->pipelines);
  for (PlannedStageInfo& s : plan->stages) s.pipeline_workers.clear();
  plan->pipelines = 1;
  Score(model, plan);
  if (pipelines > 1) ScorePipelines(model, more, plan);
  Explain(model, plan, "re-scored");
  return absl::OkStatus();
}

double GoodputSecondsPerSample(const PlannerInput& input, const PipelinePlan& plan) {
  if (input.schedule != PlannerSchedule::kAsync) return plan.time_per_sample_s;
  const int extra = std::max(0, plan.in_flight - static_cast<int>(plan.stages.size()));
  return plan.time_per_sample_s * (1 + input.staleness_cost * extra);
}

std::string ExplainPlan(const PlannerInput& input, const PipelinePlan& plan) {
  std::string out = absl::StrFormat(
      "planner %s%s: %d stages, T* %.2f ms per microbatch (bound: %s), %.3f ms per sample, "
      "W %d, round trip %.1f ms\n",
      plan.planner, plan.exact ? " (optimal)" : "", plan.stages.size(), 1e3 * plan.bottleneck_s,
      plan.bound, 1e3 * plan.time_per_sample_s, plan.in_flight, 1e3 * plan.round_trip_s);
  if (plan.predicted_s_per_sample > plan.time_per_sample_s * (1 + 1e-9)) {
    absl::StrAppendFormat(&out,
                          "  predicted %.3f ms per sample with each step's fill and drain "
                          "(plans are ranked by (M + p - 1) T* + RTTs)\n",
                          1e3 * plan.predicted_s_per_sample);
  }
  for (size_t k = 0; k < plan.stages.size(); ++k) {
    const PlannedStageInfo& s = plan.stages[k];
    const PlannerWorkerInfo& w = input.workers[s.worker];
    absl::StrAppendFormat(&out, "  stage %d  layers [%d,%d)  %-12s compute %8.2f ms", k,
                          s.layer_begin, s.layer_end, NameOf(w), 1e3 * s.compute_s);
    if (k < plan.links.size()) {
      const PlannedLinkInfo& l = plan.links[k];
      const std::string codec = l.codec_index >= 0 && l.codec_index < static_cast<int>(
                                    input.codecs.size())
                                    ? input.codecs[l.codec_index].name
                                    : "none";
      absl::StrAppendFormat(&out, "  link %8.2f ms (%s, %.2f MB, RTT %.1f ms)", 1e3 * l.transfer_s,
                            codec, l.raw_bytes / 1e6, 1e3 * l.rtt_s);
    }
    absl::StrAppend(&out, "\n      why: ", s.why, "\n");
    if (!s.replicas.empty()) {
      absl::StrAppend(&out, "      replicas:");
      for (int r : s.replicas) absl::StrAppend(&out, " ", NameOf(input.workers[r]));
      absl::StrAppend(&out, " (the stage's pace with them; a spare joins where it gains >1%)\n");
    }
  }
  if (plan.pipelines > 1) {
    for (int p = 1; p < plan.pipelines; ++p) {
      absl::StrAppendFormat(&out, "  pipeline %d:", p);
      for (const PlannedStageInfo& s : plan.stages) {
        if (p - 1 < static_cast<int>(s.pipeline_workers.size())) {
          absl::StrAppend(&out, " ", NameOf(input.workers[s.pipeline_workers[p - 1]]));
        }
      }
      absl::StrAppend(&out, "\n");
    }
  }
  if (!plan.spares.empty()) {
    absl::StrAppend(&out, "  not in the pipeline (spares):");
    for (int w : plan.spares) absl::StrAppend(&out, " ", NameOf(input.workers[w]));
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace geotrain
