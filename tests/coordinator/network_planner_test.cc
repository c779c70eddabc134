#include "coordinator/network_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <set>

namespace geotrain {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<CodecCost> Ladder() {
  return {{0, "none", 1.0, 0.0}, {1, "fp16", 0.5, 0.4e-9}, {2, "int8", 0.265, 1.0e-9}};
}

PlannerLayer Layer(double flops, uint64_t out_bytes, uint64_t memory = 1000) {
  PlannerLayer l;
  l.kind = "block";
  l.flops_per_sample = flops;
  l.output_bytes_per_sample = out_bytes;
  l.training_bytes = memory;
  return l;
}

PlannerWorkerInfo Worker(std::string id, double gflops, uint64_t memory = 0) {
  PlannerWorkerInfo w;
  w.id = std::move(id);
  w.gflops = gflops;
  w.memory_bytes = memory;
  return w;
}

// A random instance small enough for a naive search.
PlannerInput RandomInput(std::mt19937* random, int workers, int layers) {
  std::uniform_real_distribution<double> unit(0, 1);
  PlannerInput in;
  for (int w = 0; w < workers; ++w) {
    in.workers.push_back(Worker("w" + std::to_string(w), 1 + 9 * unit(*random),
                                unit(*random) < 0.3 ? 2500 + 3000 * unit(*random) : 0));
  }
  for (int l = 0; l < layers; ++l) {
    in.layers.push_back(Layer(1e8 * (0.5 + unit(*random)),
                              static_cast<uint64_t>(1e5 * (0.2 + unit(*random))),
                              static_cast<uint64_t>(500 + 1000 * unit(*random))));
  }
  in.links.resize(workers * workers);
  for (auto& link : in.links) {
    link.rate_bps = 1e8 * (0.1 + 10 * unit(*random));
    link.rtt_s = 0.1 * unit(*random);
  }
  // Some workers' ports limit their links, as a home connection does.
  for (PlannerWorkerInfo& w : in.workers) {
    if (unit(*random) < 0.4) {
      w.uplink_bps = 1e8 * (0.1 + 10 * unit(*random));
      w.downlink_bps = unit(*random) < 0.5 ? w.uplink_bps : 1e8 * (0.1 + 10 * unit(*random));
    }
  }
  in.codecs = Ladder();
  in.microbatch_size = 4;
  in.microbatches = 4;
  in.schedule = unit(*random) < 0.5 ? PlannerSchedule::kSync : PlannerSchedule::kAsync;
  if (unit(*random) < 0.3) in.max_in_flight = 3;
  return in;
}

// The same cost model written the obvious way: every cut and every codec of
// a fixed order. Returns the objective (kInf: no fit): sync, a step's
// (M + p - 1) T* plus the RTTs over M microbatches; async, T*, or with a
// window cap W, the larger of T* and the round trip (every stage, every
// link both ways, the RTTs) over W.
double NaiveBestForOrder(const PlannerInput& in, const std::vector<int>& order) {
  const int p = order.size(), layers = in.layers.size(), codecs = in.codecs.size();
  const double batch = in.microbatch_size;
  auto compute = [&](int w, int a, int b) {
    double t = 0;
    for (int l = a; l < b; ++l) t += in.layers[l].flops_per_sample / (in.workers[w].gflops * 1e9);
    return t * batch;
  };
  auto memory = [&](int a, int b) {
    uint64_t m = 0;
    for (int l = a; l < b; ++l) m += in.layers[l].training_bytes;
    return m;
  };
  auto cut_bytes = [&](int j) { return in.layers[j - 1].output_bytes_per_sample * batch; };
  auto work = [&](int c, int j) { return in.codecs[c].seconds_per_byte * cut_bytes(j); };
  // A port (access link) is shared equally by the stage's links: one at
  // either end of the pipeline, two in the middle; both of a link's
  // directions carry the same bytes, so the slower of up and down binds.
  auto port_share = [&](int k) {
    const PlannerWorkerInfo& w = in.workers[order[k]];
    double port = kInf;
    if (w.uplink_bps > 0) port = std::min(port, w.uplink_bps);
    if (w.downlink_bps > 0) port = std::min(port, w.downlink_bps);
    return port / ((k > 0) + (k + 1 < p));
  };
  auto link_time = [&](int k, int c, int j) {
    const int u = order[k], v = order[k + 1];
    const double rate = std::min({in.Link(u, v).rate_bps, in.Link(v, u).rate_bps, port_share(k),
                                  port_share(k + 1)});
    return cut_bytes(j) * in.codecs[c].ratio * 8 / rate;
  };
  auto rtt = [&](int u, int v) { return std::max(in.Link(u, v).rtt_s, in.Link(v, u).rtt_s); };
  double best = kInf;
  std::vector<int> cuts{0};  // stage k: layers [cuts[k], cuts[k + 1])
  std::vector<int> codec;    // link k: after stage k
  auto objective = [&] {
    double tau = 0, trip = 0, sum_rtt = 0;
    for (int k = 0; k < p; ++k) {
      const int w = order[k];
      const uint64_t limit = in.workers[w].memory_bytes;
      if (limit != 0 && memory(cuts[k], cuts[k + 1]) > limit) return kInf;
      double c = compute(w, cuts[k], cuts[k + 1]);
      if (k > 0) c += work(codec[k - 1], cuts[k]);
      if (k + 1 < p) c += work(codec[k], cuts[k + 1]);
      tau = std::max(tau, c);
      trip += c;
    }
    for (int k = 0; k + 1 < p; ++k) {
      const double transfer = link_time(k, codec[k], cuts[k + 1]);
      tau = std::max(tau, transfer);
      trip += 2 * transfer + rtt(order[k], order[k + 1]);
      sum_rtt += rtt(order[k], order[k + 1]);
    }
    if (in.schedule == PlannerSchedule::kSync) {
      return ((in.microbatches + p - 1) * tau + sum_rtt) / (in.microbatches * batch);
    }
    if (in.max_in_flight > 0) return std::max(tau, trip / in.max_in_flight) / batch;
    return tau / batch;
  };
  std::function<void()> place = [&] {
    const int k = static_cast<int>(cuts.size()) - 1;  // the next stage
    if (k == p) {
      if (cuts.back() == layers) best = std::min(best, objective());
      return;
    }
    for (int j = cuts.back() + 1; j <= layers; ++j) {
      cuts.push_back(j);
      if (k + 1 == p) {
        if (j == layers) place();
      } else if (j < layers) {
        for (int c = 0; c < codecs; ++c) {
          codec.push_back(c);
          place();
          codec.pop_back();
        }
      }
      cuts.pop_back();
    }
  };
  place();
  return best;
}

// Every order of every subset of up to `limit` workers.
double NaiveOptimum(const PlannerInput& in) {
  const int n = in.workers.size();
  const int limit = std::min<int>(n, in.layers.size());
  double best = kInf;
  std::vector<int> order;
  std::vector<bool> used(n, false);
  std::function<void()> visit = [&] {
    if (!order.empty()) best = std::min(best, NaiveBestForOrder(in, order));
    if (static_cast<int>(order.size()) == limit) return;
    for (int v = 0; v < n; ++v) {
      if (used[v]) continue;
      used[v] = true;
      order.push_back(v);
      visit();
      order.pop_back();
      used[v] = false;
    }
  };
  visit();
  return best;
}

TEST(NetworkPlannerTest, CutsAndCodecsForAnOrderMatchANaiveSearch) {
  std::mt19937 random(7);
  int compared = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int workers = 1 + trial % 4;
    PlannerInput in = RandomInput(&random, workers, 2 + trial % 6);
    std::vector<int> order(std::min<int>(workers, in.layers.size()));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), random);
    const double naive = NaiveBestForOrder(in, order);
    absl::StatusOr<PipelinePlan> plan = PlanForOrder(in, order);
    if (naive == kInf) {
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted) << trial;
      continue;
    }
    ASSERT_TRUE(plan.ok()) << trial << ": " << plan.status();
    EXPECT_NEAR(plan->time_per_sample_s / naive, 1.0, 1e-6) << trial;
    // The plan is what it says: rescoring its cuts and codecs gives the same.
    PipelinePlan rescored = *plan;
    ASSERT_TRUE(ScorePlan(in, &rescored).ok());
    EXPECT_DOUBLE_EQ(rescored.time_per_sample_s, plan->time_per_sample_s);
    ++compared;
  }
  EXPECT_GT(compared, 100);
}

TEST(NetworkPlannerTest, UpToEightWorkersThePlanIsOptimal) {
  std::mt19937 random(11);
  auto planner = MakeNetworkPlanner();
  for (int trial = 0; trial < 40; ++trial) {
    PlannerInput in = RandomInput(&random, 2 + trial % 4, 3 + trial % 4);
    const double optimum = NaiveOptimum(in);
    absl::StatusOr<PipelinePlan> plan = planner->Plan(in);
    if (optimum == kInf) {
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
      continue;
    }
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->exact);
    EXPECT_NEAR(plan->time_per_sample_s / optimum, 1.0, 1e-6) << trial;
  }
}

// Two regions, 2 Gb/s and 1 ms inside, 100 Mb/s and 80 ms between; the
// workers join alternating between them. Sync, so every crossing's latency
// is paid each step; wide activations, so a crossing's link binds.
PlannerInput TwoRegions(int per_region) {
  PlannerInput in;
  const int n = 2 * per_region;
  for (int w = 0; w < n; ++w) in.workers.push_back(Worker("w" + std::to_string(w), 10));
  in.links.resize(n * n);
  for (int u = 0; u < n; ++u) {
    for (int v = 0; v < n; ++v) {
      const bool same = u % 2 == v % 2;
      in.links[u * n + v] = {same ? 0.001 : 0.080, same ? 2e9 : 1e8};
    }
  }
  for (int l = 0; l < 12; ++l) in.layers.push_back(Layer(1e8, 1600000));
  in.codecs = Ladder();
  in.schedule = PlannerSchedule::kSync;
  in.microbatches = 8;
  in.microbatch_size = 8;
  return in;
}

int RegionCrossings(const PipelinePlan& plan) {
  int crossings = 0;
  for (size_t k = 1; k < plan.stages.size(); ++k) {
    if (plan.stages[k].worker % 2 != plan.stages[k - 1].worker % 2) ++crossings;
  }
  return crossings;
}

TEST(NetworkPlannerTest, APipelineCrossesBetweenRegionsOnceAndCompressesOnlyThere) {
  PlannerInput in = TwoRegions(3);
  absl::StatusOr<PipelinePlan> join = MakeJoinOrderPlanner()->Plan(in);
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(join.ok() && plan.ok());
  EXPECT_EQ(RegionCrossings(*join), 5);
  EXPECT_LE(RegionCrossings(*plan), 1) << ExplainPlan(in, *plan);
  EXPECT_LT(plan->time_per_sample_s, join->time_per_sample_s / 2) << ExplainPlan(in, *plan);
  for (size_t k = 0; k < plan->links.size(); ++k) {
    const bool crossing = plan->stages[k].worker % 2 != plan->stages[k + 1].worker % 2;
    const std::string codec = in.codecs[plan->links[k].codec_index].name;
    if (crossing) {
      EXPECT_NE(codec, "none") << ExplainPlan(in, *plan);
    } else {
      EXPECT_EQ(codec, "none") << ExplainPlan(in, *plan);
    }
  }
  const std::string explained = ExplainPlan(in, *plan);
  EXPECT_NE(explained.find("stage 0"), std::string::npos);
  EXPECT_NE(explained.find("why:"), std::string::npos);
  EXPECT_NE(explained.find("bound:"), std::string::npos);
}

// Three workers behind ports of 100 Mb/s each way (the lab's per-host
// tbf), every pair measured at that rate: the middle worker's port carries
// both of its links, so each gets half, and the planner compresses where a
// model of independent pairs would send raw.
TEST(NetworkPlannerTest, AMiddleStageSharesItsPortBetweenItsTwoLinks) {
  PlannerInput in;
  for (int w = 0; w < 3; ++w) in.workers.push_back(Worker("w" + std::to_string(w), 100));
  in.links.assign(9, {0.0005, 1e8});
  // 4 identical blocks; at 8 samples a cut carries 1 MB each way: 80 ms at
  // 100 Mb/s raw, against 25 ms of compute per block and microbatch.
  for (int l = 0; l < 4; ++l) in.layers.push_back(Layer(2.5e9 / 8 * 100 / 1e2, 125000));
  in.codecs = Ladder();
  in.microbatch_size = 8;
  in.max_stages = 3;
  std::vector<int> order = {0, 1, 2};
  absl::StatusOr<PipelinePlan> pairs_only = PlanForOrder(in, order);
  ASSERT_TRUE(pairs_only.ok()) << pairs_only.status();
  for (PlannerWorkerInfo& w : in.workers) w.uplink_bps = w.downlink_bps = 1e8;
  absl::StatusOr<PipelinePlan> shared = PlanForOrder(in, order);
  ASSERT_TRUE(shared.ok()) << shared.status();
  ASSERT_EQ(shared->links.size(), 2u);
  // Each link's transfer at the codec chosen: half the port's rate.
  for (size_t k = 0; k < shared->links.size(); ++k) {
    const PlannedLinkInfo& link = shared->links[k];
    const double ratio = in.codecs[link.codec_index].ratio;
    EXPECT_NEAR(link.transfer_s, link.raw_bytes * ratio * 8 / 5e7, 1e-12) << k;
  }
  // The shared ports cost more, and the planner answers with stronger codecs.
  EXPECT_GT(shared->time_per_sample_s, pairs_only->time_per_sample_s);
  double pairs_ratio = 0, shared_ratio = 0;
  for (const PlannedLinkInfo& l : pairs_only->links) pairs_ratio += in.codecs[l.codec_index].ratio;
  for (const PlannedLinkInfo& l : shared->links) shared_ratio += in.codecs[l.codec_index].ratio;
  EXPECT_LT(shared_ratio, pairs_ratio) << ExplainPlan(in, *shared);
  EXPECT_NE(ExplainPlan(in, *shared).find("as the ports' links share them"), std::string::npos)
      << ExplainPlan(in, *shared);
  // A port faster than the pair's path (per-pair shaping) changes nothing.
  for (PlannerWorkerInfo& w : in.workers) w.uplink_bps = w.downlink_bps = 1e9;
  absl::StatusOr<PipelinePlan> wide = PlanForOrder(in, order);
  ASSERT_TRUE(wide.ok());
  EXPECT_DOUBLE_EQ(wide->time_per_sample_s, pairs_only->time_per_sample_s);
  // An asymmetric port: the slower direction binds (its uplink here).
  in.workers[1].uplink_bps = 2e7;
  absl::StatusOr<PipelinePlan> slow_up = PlanForOrder(in, order);
  ASSERT_TRUE(slow_up.ok());
  EXPECT_NEAR(slow_up->links[0].transfer_s,
              slow_up->links[0].raw_bytes * in.codecs[slow_up->links[0].codec_index].ratio * 8 / 1e7,
              1e-12);
}

// Six equal workers, six equal layers, every pair at 100 Mb/s and raw only:
// a link binds a pipeline at 40 ms a microbatch however many stages it has
// (a layer computes in 20 ms), so a second pipeline of three doubles the
// job's rate where six stages in one would not.
PlannerInput LinkBoundSix(uint64_t parameter_bytes_per_layer) {
  PlannerInput in;
  for (int w = 0; w < 6; ++w) in.workers.push_back(Worker("w" + std::to_string(w), 100));
  in.links.assign(36, {0.0005, 1e8});
  for (int l = 0; l < 6; ++l) {
    PlannerLayer layer = Layer(2.5e8, 62500);
    layer.parameter_bytes = parameter_bytes_per_layer;
    in.layers.push_back(layer);
  }
  in.codecs = {{0, "none", 1.0, 0.0}};
  in.microbatch_size = 8;
  in.microbatches = 4;
  in.max_pipelines = 0;  // job.outer without a cap
  in.outer_inner_steps = 50;
  in.outer_ratio = 0.25;
  return in;
}

TEST(NetworkPlannerTest, PipelinesAreAddedWhereALinkBindsOne) {
  PlannerInput in = LinkBoundSix(/*parameter_bytes_per_layer=*/1000);
  PlannerInput one = in;
  one.max_pipelines = 1;
  absl::StatusOr<PipelinePlan> single = MakeNetworkPlanner()->Plan(one);
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(single.ok() && plan.ok());
  EXPECT_EQ(single->pipelines, 1);
  ASSERT_GE(plan->pipelines, 2) << ExplainPlan(in, *plan);
  EXPECT_FALSE(plan->exact);  // R is chosen greedily
  // Every worker at most once, each stage with one worker per pipeline.
  std::set<int> used;
  for (const PlannedStageInfo& s : plan->stages) {
    EXPECT_TRUE(used.insert(s.worker).second);
    ASSERT_EQ(static_cast<int>(s.pipeline_workers.size()), plan->pipelines - 1);
    for (int w : s.pipeline_workers) EXPECT_TRUE(used.insert(w).second) << w;
    EXPECT_TRUE(s.replicas.empty());
  }
  EXPECT_EQ(used.size() + plan->spares.size(), 6u);
  // R pipelines at 40 ms a microbatch of 8, and next to nothing to sync.
  EXPECT_NEAR(plan->time_per_sample_s, 0.040 / 8 / plan->pipelines, 1e-6)
      << ExplainPlan(in, *plan);
  EXPECT_LT(plan->time_per_sample_s, single->time_per_sample_s / 1.9);
  EXPECT_NE(ExplainPlan(in, *plan).find("pipeline 1:"), std::string::npos);
  // A cap on R is kept.
  in.max_pipelines = 2;
  absl::StatusOr<PipelinePlan> capped = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(capped.ok());
  EXPECT_LE(capped->pipelines, 2);
}

// Split (OuterOptimizer.split_batch), a round is H steps of the job's
// batch whatever R, so two pipelines' outer sync weighs twice as much a
// sample as when each runs the whole batch.
TEST(NetworkPlannerTest, ASplitBatchSpreadsTheOuterSyncOverFewerSamples) {
  PlannerInput in = LinkBoundSix(/*parameter_bytes_per_layer=*/4000000);
  in.max_pipelines = 2;
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pipelines, 2) << ExplainPlan(in, *plan);
  PipelinePlan whole = *plan, split = *plan, no_sync = *plan;
  ASSERT_TRUE(ScorePlan(in, &whole).ok());
  PlannerInput split_in = in;
  split_in.outer_split_batch = true;
  ASSERT_TRUE(ScorePlan(split_in, &split).ok());
  PlannerInput no_sync_in = in;
  no_sync_in.outer_inner_steps = 1000000000;  // the pipelines alone
  ASSERT_TRUE(ScorePlan(no_sync_in, &no_sync).ok());
  const double compute = no_sync.time_per_sample_s;
  ASSERT_GT(whole.time_per_sample_s - compute, 1e-6);
  EXPECT_NEAR(split.time_per_sample_s - compute, 2 * (whole.time_per_sample_s - compute),
              1e-3 * (split.time_per_sample_s - compute));
}

// A voluntary re-plan of an outer job compares the plan the workers run
// with the planner's best: re-scored, the planner's own R pipelines give
// its figures, and a slower worker in one pipeline holds the job to it.
TEST(NetworkPlannerTest, ScoringRPipelinesGivesThePlannersFigures) {
  PlannerInput in = LinkBoundSix(/*parameter_bytes_per_layer=*/1000);
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_GE(plan->pipelines, 2);
  PipelinePlan rescored = *plan;
  ASSERT_TRUE(ScorePlan(in, &rescored).ok());
  EXPECT_EQ(rescored.pipelines, plan->pipelines);
  EXPECT_NEAR(rescored.time_per_sample_s, plan->time_per_sample_s,
              1e-9 * plan->time_per_sample_s);
  EXPECT_NEAR(rescored.predicted_s_per_sample, plan->predicted_s_per_sample,
              1e-9 * plan->predicted_s_per_sample);
  for (size_t k = 0; k < plan->stages.size(); ++k) {
    EXPECT_EQ(rescored.stages[k].pipeline_workers, plan->stages[k].pipeline_workers);
  }
  // The last pipeline's first stage on a worker ten times slower.
  PlannerInput slower = in;
  const int moved = plan->stages[0].pipeline_workers.back();
  slower.workers[moved].gflops /= 10;
  for (auto& [kind, seconds] : slower.workers[moved].seconds_per_sample) seconds *= 10;
  PipelinePlan held = *plan;
  ASSERT_TRUE(ScorePlan(slower, &held).ok());
  EXPECT_GT(held.time_per_sample_s, 2 * plan->time_per_sample_s) << ExplainPlan(slower, held);
  // A stage without its worker in every pipeline is refused.
  PipelinePlan torn = *plan;
  torn.stages[0].pipeline_workers.pop_back();
  EXPECT_EQ(ScorePlan(in, &torn).code(), absl::StatusCode::kInvalidArgument);
}

// A job step waits for every pipeline: a pipeline of workers ten times
// slower would hold the others to its pace (R times the slowest), so it is
// not added, though its samples would add up if the pipelines ran apart.
TEST(NetworkPlannerTest, ASlowPipelineIsNotAddedForItsSamplesAlone) {
  PlannerInput in;
  for (double gflops : {100.0, 100.0, 10.0, 10.0}) {
    in.workers.push_back(Worker("w" + std::to_string(in.workers.size()), gflops));
  }
  in.links.assign(16, {0.0005, 1e10});
  for (int l = 0; l < 4; ++l) in.layers.push_back(Layer(2.5e8, 1000));
  in.codecs = {{0, "none", 1.0, 0.0}};
  in.microbatch_size = 8;
  in.max_stages = 2;
  in.max_pipelines = 0;
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  for (const PlannedStageInfo& s : plan->stages) {
    EXPECT_LT(s.worker, 2) << ExplainPlan(in, *plan);
    for (int w : s.pipeline_workers) EXPECT_LT(w, 2) << ExplainPlan(in, *plan);
  }
}

// The same, but each layer holds 1 GB of weights: the outer sync would send
// 0.5 GB per stage and round over 100 Mb/s, more than a second pipeline
// gains, so the plan keeps one.
TEST(NetworkPlannerTest, TheOuterSyncsTrafficCanMakeOnePipelineBest) {
  PlannerInput in = LinkBoundSix(/*parameter_bytes_per_layer=*/1000000000);
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->pipelines, 1) << ExplainPlan(in, *plan);
  for (const PlannedStageInfo& s : plan->stages) EXPECT_TRUE(s.pipeline_workers.empty());
  // More inner steps between syncs make the traffic per sample small.
  in.outer_inner_steps = 100000;
  absl::StatusOr<PipelinePlan> rare = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(rare.ok());
  EXPECT_GE(rare->pipelines, 2) << ExplainPlan(in, *rare);
}

TEST(NetworkPlannerTest, ASpareReplicatesTheBottleneckStageOnlyWhereItPays) {
  // Three layers, the middle one ten times heavier; three stages at most.
  PlannerInput in;
  for (int w = 0; w < 4; ++w) in.workers.push_back(Worker("w" + std::to_string(w), 10));
  for (double flops : {1e8, 1e9, 1e8}) in.layers.push_back(Layer(flops, 1000));
  in.microbatch_size = 4;
  in.microbatches = 4;
  in.max_stages = 3;
  in.codecs = Ladder();
  absl::StatusOr<PipelinePlan> alone = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(alone.ok());
  ASSERT_EQ(alone->stages.size(), 3u);
  EXPECT_TRUE(alone->stages[1].replicas.empty());  // job.replicas 1: none
  EXPECT_EQ(alone->spares.size(), 1u);

  in.max_replicas = 2;
  absl::StatusOr<PipelinePlan> replicated = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(replicated.ok());
  ASSERT_EQ(replicated->stages.size(), 3u);
  ASSERT_EQ(replicated->stages[1].replicas.size(), 1u) << ExplainPlan(in, *replicated);
  EXPECT_TRUE(replicated->spares.empty());
  // Two equal workers halve the stage's pace (the weights are tiny here).
  EXPECT_NEAR(replicated->stages[1].compute_s, alone->stages[1].compute_s / 2,
              1e-3 * alone->stages[1].compute_s);
  EXPECT_LT(replicated->time_per_sample_s, alone->time_per_sample_s * 0.6);
  EXPECT_NE(ExplainPlan(in, *replicated).find("replicas: w"), std::string::npos);
  // The same plan re-scored gives the same figures.
  PipelinePlan rescored = *replicated;
  ASSERT_TRUE(ScorePlan(in, &rescored).ok());
  EXPECT_DOUBLE_EQ(rescored.time_per_sample_s, replicated->time_per_sample_s);

  // A spare that may not replicate (a demoted straggler) stays a spare.
  const int spare = replicated->stages[1].replicas[0];
  in.workers[spare].may_replicate = false;
  absl::StatusOr<PipelinePlan> barred = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(barred.ok());
  for (const PlannedStageInfo& stage : barred->stages) {
    for (int r : stage.replicas) EXPECT_NE(r, spare) << ExplainPlan(in, *barred);
  }
  in.workers[spare].may_replicate = true;

  // Heavy weights over slow links: averaging them would cost more than the
  // replica gains, so the spare stays a spare.
  for (PlannerLayer& layer : in.layers) layer.parameter_bytes = 1000000000;
  in.links.assign(16, {0.001, 1e8});
  absl::StatusOr<PipelinePlan> costly = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(costly.ok());
  for (const PlannedStageInfo& stage : costly->stages) EXPECT_TRUE(stage.replicas.empty());
  EXPECT_EQ(costly->spares.size(), 1u);
}

TEST(NetworkPlannerTest, AReplicatedStageTakesLayersFromItsNeighbours) {
  // Four equal layers on at most three stages: one stage must hold two. A
  // replica of the middle stage lets that be the middle one, at the pace of
  // one layer (stage 0 holding two with a replica would tie; ties go to the
  // middle stages).
  PlannerInput in;
  for (int w = 0; w < 4; ++w) in.workers.push_back(Worker("w" + std::to_string(w), 10));
  for (int l = 0; l < 4; ++l) in.layers.push_back(Layer(1e8, 1000));
  in.microbatch_size = 4;
  in.max_stages = 3;
  in.max_replicas = 2;
  in.codecs = Ladder();
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->stages.size(), 3u);
  const double layer_s = 1e8 / 10e9 * 4;
  ASSERT_EQ(plan->stages[1].replicas.size(), 1u) << ExplainPlan(in, *plan);
  EXPECT_TRUE(plan->stages[0].replicas.empty()) << ExplainPlan(in, *plan);
  EXPECT_EQ(plan->stages[1].layer_end - plan->stages[1].layer_begin, 2) << ExplainPlan(in, *plan);
  EXPECT_NEAR(plan->bottleneck_s, layer_s, 1e-3 * layer_s) << ExplainPlan(in, *plan);
}

TEST(NetworkPlannerTest, ABottleneckFirstStageGetsAReplica) {
  // Stage 0's one heavy layer binds (the layers cannot be cut finer): a
  // spare as its replica halves its pace, as for any other stage.
  PlannerInput in;
  for (int w = 0; w < 3; ++w) in.workers.push_back(Worker("w" + std::to_string(w), 10));
  for (double flops : {1e9, 1e8}) in.layers.push_back(Layer(flops, 1000));
  in.microbatch_size = 4;
  in.max_stages = 2;
  in.max_replicas = 2;
  in.codecs = Ladder();
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->stages.size(), 2u) << ExplainPlan(in, *plan);
  ASSERT_EQ(plan->stages[0].replicas.size(), 1u) << ExplainPlan(in, *plan);
  EXPECT_TRUE(plan->stages[1].replicas.empty());
  const double layer_s = 1e9 / 10e9 * 4;
  EXPECT_NEAR(plan->stages[0].compute_s, layer_s / 2, 1e-3 * layer_s) << ExplainPlan(in, *plan);
}

TEST(NetworkPlannerTest, TheWindowCoversTheRoundTrip) {
  PlannerInput in = TwoRegions(2);
  in.schedule = PlannerSchedule::kAsync;
  for (auto& link : in.links) link.rtt_s = 0.2;
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_GT(plan->stages.size(), 1u);
  EXPECT_GE(plan->in_flight * plan->bottleneck_s, plan->round_trip_s * (1 - 1e-9));
  // With W capped below it, the cap binds and says so.
  in.max_in_flight = 2;
  plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_LE(plan->in_flight, 2);
}

// Goodput: with a staleness cost per microbatch in flight beyond one per
// stage, the plan is the best over every window cap of its samples/s times
// its staleness, not the plan whose window covers the round trip. The lab
// case: three demo-like stages whose round trip is a few bottlenecks long
// (bench/vs_ddp: W 5 gave 1.5% more samples/s than W 3 and a worse loss).
TEST(NetworkPlannerTest, AWindowIsWidenedOnlyWhereItsSamplesPayForItsStaleness) {
  PlannerInput in;
  in.workers = {Worker("a", 10), Worker("b", 10), Worker("c", 10)};
  in.links.assign(9, {0.0002, 1e8});
  for (int l = 0; l < 6; ++l) in.layers.push_back(Layer(1e7, 64 * 128 * 4));
  in.codecs = Ladder();
  in.schedule = PlannerSchedule::kAsync;
  in.microbatch_size = 16;
  in.max_in_flight = 32;
  absl::StatusOr<PipelinePlan> widest = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(widest.ok()) << widest.status();
  ASSERT_GT(widest->in_flight, static_cast<int>(widest->stages.size())) << ExplainPlan(in, *widest);
  const double cost = 0.35;
  auto goodput_cost = [cost](const PipelinePlan& p) {
    return p.time_per_sample_s *
           (1 + cost * std::max(0, p.in_flight - static_cast<int>(p.stages.size())));
  };
  // The figure the planner minimises is this one.
  in.staleness_cost = cost;
  EXPECT_DOUBLE_EQ(GoodputSecondsPerSample(in, *widest), goodput_cost(*widest));
  in.staleness_cost = cost;
  absl::StatusOr<PipelinePlan> chosen = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_LT(chosen->in_flight, widest->in_flight) << ExplainPlan(in, *chosen);
  EXPECT_GE(chosen->in_flight, static_cast<int>(chosen->stages.size()));
  EXPECT_FALSE(chosen->exact);
  EXPECT_LT(goodput_cost(*chosen), goodput_cost(*widest));
  EXPECT_NE(chosen->bound.find("the window ("), std::string::npos) << chosen->bound;
  // No window cap gives a plan with a better goodput.
  for (int cap = 1; cap <= widest->in_flight; ++cap) {
    PlannerInput capped = in;
    capped.staleness_cost = 0;
    capped.max_in_flight = cap;
    absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(capped);
    ASSERT_TRUE(plan.ok()) << plan.status();
    // Workers run at least one microbatch in flight per stage.
    if (plan->in_flight < static_cast<int>(plan->stages.size())) continue;
    EXPECT_LE(goodput_cost(*chosen), goodput_cost(*plan) * (1 + 1e-9)) << "cap " << cap;
  }
  // Where the round trip is long and staleness cheap, a wide window pays.
  // (With a linear cost of c per version a window wider than the stages
  // pays only where c < 1 / stages: the round trip's samples grow as W,
  // their cost as 1 + c (W - P).)
  for (auto& link : in.links) link.rtt_s = 0.2;
  in.staleness_cost = 0.05;
  absl::StatusOr<PipelinePlan> far = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(far.ok()) << far.status();
  EXPECT_GT(far->in_flight, static_cast<int>(far->stages.size())) << ExplainPlan(in, *far);
}

// The demo's shape at 100 Mb/s: two stages of about 48 ms a microbatch, an
// activation of 42 ms raw. Uncapped, the link is not the bottleneck and
// stays raw (the cheapest codec that keeps up). With W capped at 2 the
// round trip sets the pace and every transfer is on it: the strongest codec
// wins, as bench/vs_ddp measured (int8 on this link: 1.76x raw's samples/s).
TEST(NetworkPlannerTest, UnderAWindowCapAStrongerCodecPaysOnAFastLink) {
  PlannerInput in;
  in.workers = {Worker("a", 10), Worker("b", 10)};
  in.links.assign(4, {0.0002, 1e8});
  for (int l = 0; l < 6; ++l) in.layers.push_back(Layer(1e7, 64 * 128 * 4));
  in.codecs = Ladder();
  in.schedule = PlannerSchedule::kAsync;
  in.microbatch_size = 16;
  absl::StatusOr<PipelinePlan> uncapped = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(uncapped.ok()) << uncapped.status();
  ASSERT_EQ(uncapped->stages.size(), 2u);
  EXPECT_EQ(in.codecs[uncapped->links[0].codec_index].name, "none");
  in.max_in_flight = 2;
  absl::StatusOr<PipelinePlan> capped = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(capped.ok()) << capped.status();
  ASSERT_EQ(capped->stages.size(), 2u);
  EXPECT_EQ(in.codecs[capped->links[0].codec_index].name, "int8");
  EXPECT_EQ(capped->in_flight, 2);
  EXPECT_TRUE(capped->exact);
  EXPECT_EQ(capped->bound, "the in-flight cap (2) against the round trip");
  // Against the same cuts kept raw, the cap costs raw T / (T + t) of its pace.
  PipelinePlan raw = *capped;
  raw.links[0].codec_index = 0;
  ASSERT_TRUE(ScorePlan(in, &raw).ok());
  EXPECT_GT(raw.time_per_sample_s / capped->time_per_sample_s, 1.4);
  EXPECT_NEAR(raw.round_trip_s, 2 * (0.048 + 0.0419) + 0.0002, 1e-3);
}

TEST(NetworkPlannerTest, SyncOnAFarLinkKeepsToFewerStages) {
  // Two equal workers 1 s apart: sync pays the round trip every step
  // (more than halving the compute saves), which one worker alone does not.
  PlannerInput in;
  in.workers = {Worker("a", 10), Worker("b", 10)};
  in.links = {{0, 1e9}, {1.0, 1e9}, {1.0, 1e9}, {0, 1e9}};
  for (int l = 0; l < 4; ++l) in.layers.push_back(Layer(1e8, 1000));
  in.schedule = PlannerSchedule::kSync;
  in.microbatches = 4;
  in.microbatch_size = 8;
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->stages.size(), 1u);
  ASSERT_EQ(plan->spares.size(), 1u);
  // Async hides it: both are used.
  in.schedule = PlannerSchedule::kAsync;
  plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->stages.size(), 2u);
}

TEST(NetworkPlannerTest, ASyncPredictionCountsTheFillAndDrainOverSlowLinks) {
  // Two stages of two layers (40 ms each per microbatch) over a link that
  // takes 30 ms a microbatch each way: a step of M = 4 is (M - 1) T* plus
  // one microbatch through both stages and over the link both ways.
  PlannerInput in;
  in.workers = {Worker("a", 10), Worker("b", 10)};
  for (int l = 0; l < 4; ++l) in.layers.push_back(Layer(5e7, 7500));  // 20 ms each
  in.links.assign(4, {0.002, 8e6});  // 7500 B x 4 samples x 8 / 8e6 = 30 ms
  in.schedule = PlannerSchedule::kSync;
  in.microbatches = 4;
  in.microbatch_size = 4;
  in.max_stages = 2;
  PipelinePlan plan;
  plan.stages = {{0, 0, 2}, {1, 2, 4}};
  ASSERT_TRUE(ScorePlan(in, &plan).ok());
  EXPECT_NEAR(plan.bottleneck_s, 0.040, 1e-9);
  EXPECT_NEAR(plan.links[0].transfer_s, 0.030, 1e-9);
  // Ranked by (M + p - 1) T* + RTT; predicted with the whole trip.
  EXPECT_NEAR(plan.time_per_sample_s, (5 * 0.040 + 0.002) / 16, 1e-12);
  EXPECT_NEAR(plan.predicted_s_per_sample, (3 * 0.040 + 0.080 + 0.060 + 0.002) / 16, 1e-12);
  EXPECT_NE(ExplainPlan(in, plan).find("fill and drain"), std::string::npos);
  // Async: the prediction is the objective.
  in.schedule = PlannerSchedule::kAsync;
  ASSERT_TRUE(ScorePlan(in, &plan).ok());
  EXPECT_EQ(plan.predicted_s_per_sample, plan.time_per_sample_s);
}

TEST(NetworkPlannerTest, MeasuredLayerTimesWinOverGflops) {
  PlannerInput in;
  in.workers = {Worker("a", 10), Worker("b", 10)};
  // b's benchmark says it is as fast, but it measured its blocks 3x slower.
  in.workers[1].seconds_per_sample["block"] = 3 * 1e9 / 10e9;
  for (int l = 0; l < 8; ++l) in.layers.push_back(Layer(1e9, 10));
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->stages.size(), 2u);
  for (const PlannedStageInfo& s : plan->stages) {
    EXPECT_EQ(s.layer_end - s.layer_begin, s.worker == 0 ? 6 : 2) << ExplainPlan(in, *plan);
  }
}

TEST(NetworkPlannerTest, MemoryDecidesWhatFits) {
  PlannerInput in;
  for (int l = 0; l < 4; ++l) in.layers.push_back(Layer(1e9, 10, 100));
  in.workers = {Worker("big-but-slow", 1, 1000), Worker("small", 100, 150),
                Worker("small2", 100, 150)};
  absl::StatusOr<PipelinePlan> plan = MakeNetworkPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const PlannedStageInfo& s : plan->stages) {
    const uint64_t need = 100 * (s.layer_end - s.layer_begin);
    EXPECT_LE(need, in.workers[s.worker].memory_bytes);
  }
  in.workers = {Worker("tiny", 10, 50), Worker("tiny2", 10, 50)};
  EXPECT_EQ(MakeNetworkPlanner()->Plan(in).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(MakeJoinOrderPlanner()->Plan(in).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(NetworkPlannerTest, ManyWorkersAreSearchedDeterministically) {
  // 24 workers in 3 regions, 40 layers: the local search, twice.
  PlannerInput in;
  const int n = 24;
  for (int w = 0; w < n; ++w) {
    in.workers.push_back(Worker("w" + std::to_string(w), w % 3 == 0 ? 30 : (w % 3 == 1 ? 10 : 3)));
  }
  in.links.resize(n * n);
  for (int u = 0; u < n; ++u) {
    for (int v = 0; v < n; ++v) {
      const bool same = u % 3 == v % 3 || u / 8 == v / 8;
      in.links[u * n + v] = {same ? 0.002 : 0.1, same ? 2e9 : 2e8};
    }
  }
  for (int l = 0; l < 40; ++l) in.layers.push_back(Layer(2e9, 300000));
  in.codecs = Ladder();
  in.microbatch_size = 4;
  auto planner = MakeNetworkPlanner();
  absl::StatusOr<PipelinePlan> first = planner->Plan(in);
  absl::StatusOr<PipelinePlan> second = planner->Plan(in);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_FALSE(first->exact);
  EXPECT_EQ(ExplainPlan(in, *first), ExplainPlan(in, *second));
  absl::StatusOr<PipelinePlan> join = MakeJoinOrderPlanner()->Plan(in);
  ASSERT_TRUE(join.ok());
  EXPECT_LT(first->time_per_sample_s, join->time_per_sample_s);
}

TEST(NetworkPlannerTest, BadInputIsAnError) {
  PlannerInput in;
  EXPECT_EQ(MakeNetworkPlanner()->Plan(in).status().code(), absl::StatusCode::kInvalidArgument);
  in.layers.push_back(Layer(1, 1));
  EXPECT_EQ(MakeNetworkPlanner()->Plan(in).status().code(),
            absl::StatusCode::kFailedPrecondition);
  in.workers.push_back(Worker("a", 1));
  in.links.resize(3);
  EXPECT_EQ(MakeNetworkPlanner()->Plan(in).status().code(), absl::StatusCode::kInvalidArgument);
  in.links.clear();
  EXPECT_EQ(PlanForOrder(in, {5}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace geotrain

namespace geotrain {
namespace {

// Pipelines (job.outer): R full chains of P stages, from the fastest R x P
// workers in join order, with one cut for all of them; the rest spares.
TEST(JoinOrderPipelinesTest, FullPipelinesOfMaxStagesWithOneCut) {
  PlannerInput in;
  for (int w = 0; w < 7; ++w) in.workers.push_back(Worker("w" + std::to_string(w), w == 6 ? 1 : 5));
  for (int l = 0; l < 6; ++l) in.layers.push_back(Layer(1e8, 1000));
  for (PlannerLayer& l : in.layers) l.parameter_bytes = 4000;
  in.links.assign(49, {0.001, 1e9});
  in.codecs = Ladder();
  in.max_stages = 3;
  in.max_pipelines = 0;  // as many as fill
  in.outer_inner_steps = 50;
  absl::StatusOr<PipelinePlan> plan = MakeJoinOrderPlanner()->Plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->pipelines, 2);
  ASSERT_EQ(plan->stages.size(), 3u);
  // Pipeline 0: w0 w1 w2; pipeline 1: w3 w4 w5; w6 (slowest) is spare.
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(plan->stages[k].worker, k);
    ASSERT_EQ(plan->stages[k].pipeline_workers.size(), 1u);
    EXPECT_EQ(plan->stages[k].pipeline_workers[0], 3 + k);
  }
  EXPECT_EQ(plan->spares, std::vector<int>({6}));
  // Two pipelines: about half the time per sample of one, plus the outer
  // sync's share.
  in.max_pipelines = 1;
  absl::StatusOr<PipelinePlan> one = MakeJoinOrderPlanner()->Plan(in);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->pipelines, 1);
  EXPECT_GT(plan->time_per_sample_s, one->time_per_sample_s / 2);
  EXPECT_LT(plan->time_per_sample_s, one->time_per_sample_s * 0.6);
  // At most max_pipelines.
  in.max_pipelines = 2;
  in.max_stages = 2;
  absl::StatusOr<PipelinePlan> capped = MakeJoinOrderPlanner()->Plan(in);
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ(capped->pipelines, 2);
  EXPECT_EQ(capped->spares.size(), 3u);
}

TEST(ReplicableStagesTest, MiddleStagesThenTheFirstNeverTheLast) {
  EXPECT_TRUE(ReplicableStages(1).empty());
  EXPECT_EQ(ReplicableStages(2), (std::vector<int>{0}));
  EXPECT_EQ(ReplicableStages(4), (std::vector<int>{1, 2, 0}));
}

}  // namespace
}  // namespace geotrain
