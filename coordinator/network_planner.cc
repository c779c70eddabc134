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

constexpr double kInf = std::numeric_limits<double>::infinity();
// A plan must beat the incumbent by this fraction to replace it, so equal
// plans keep the first one found (deterministic) and bounds prune ties.
constexpr double kStrictlyBetter = 1e-9;

std::string NameOf(const PlannerWorkerInfo& w) { return w.name.empty() ? w.id : w.name; }

// Tables derived once from a PlannerInput; every cost the searches need is a
// lookup or a subtraction. Indices: workers w in [0, n), cuts j in [0, L]
// (cut j lies before layer j; 0 and L are the pipeline's ends).
class CostModel {
 public:
  explicit CostModel(const PlannerInput& input) : in_(input) {
    n_ = static_cast<int>(input.workers.size());
    layers_ = static_cast<int>(input.layers.size());
    codecs_ = input.codecs;
    if (codecs_.empty()) codecs_.push_back({0, "none", 1.0, 0.0});
    const double batch = std::max(1, input.microbatch_size);
    prefix_.assign(n_, std::vector<double>(layers_ + 1, 0));
    for (int w = 0; w < n_; ++w) {
      const PlannerWorkerInfo& worker = input.workers[w];
      const double flops_per_s = std::max(worker.gflops, 1e-6) * 1e9;
      for (int l = 0; l < layers_; ++l) {
        const PlannerLayer& layer = input.layers[l];
        auto measured = worker.seconds_per_sample.find(layer.kind);
        const double per_sample = measured != worker.seconds_per_sample.end() && measured->second > 0
                                      ? measured->second
                                      : layer.flops_per_sample / flops_per_s;
        prefix_[w][l + 1] = prefix_[w][l] + per_sample * batch;
      }
    }
    memory_prefix_.assign(layers_ + 1, 0);
    parameter_prefix_.assign(layers_ + 1, 0);
    cut_bytes_.assign(layers_ + 1, 0);
    for (int l = 0; l < layers_; ++l) {
      memory_prefix_[l + 1] = memory_prefix_[l] + input.layers[l].training_bytes;
      parameter_prefix_[l + 1] = parameter_prefix_[l] + input.layers[l].parameter_bytes;
      if (l + 1 < layers_) {
        cut_bytes_[l + 1] = static_cast<double>(input.layers[l].output_bytes_per_sample) * batch;
      }
    }
    // lowest_start_[w][j]: the first layer a stage on w ending at j may start
    // at within w's memory (j + 1 when not even layer j - 1 fits).
    lowest_start_.assign(n_, std::vector<int>(layers_ + 1, 0));
    for (int w = 0; w < n_; ++w) {
      const uint64_t memory = input.workers[w].memory_bytes;
      int i = 0;
      for (int j = 0; j <= layers_; ++j) {
        if (memory != 0) {
          while (i < j && memory_prefix_[j] - memory_prefix_[i] > memory) ++i;
        }
        lowest_start_[w][j] = (memory != 0 && j > 0 && i == j) ? j + 1 : i;
      }
    }
    // Both directions of a link carry the same bytes (the gradient of an
    // activation has its size, with the link's codec), so an end's uplink
    // and downlink carry equal loads: the slower of the two binds.
    access_.assign(n_, kInf);
    for (int w = 0; w < n_; ++w) {
      for (double bps : {input.workers[w].uplink_bps, input.workers[w].downlink_bps}) {
        if (bps > 0) access_[w] = std::min(access_[w], bps);
      }
    }
    rate_.assign(static_cast<size_t>(n_) * n_, 0);
    rtt_.assign(static_cast<size_t>(n_) * n_, 0);
    for (int u = 0; u < n_; ++u) {
      for (int v = 0; v < n_; ++v) {
        const LinkEstimate forward = input.Link(u, v);
        const LinkEstimate backward = input.Link(v, u);
        // Full duplex: the slower direction sets the pace; a round trip
        // crosses both.
        rate_[Index(u, v)] = std::min(forward.rate_bps, backward.rate_bps);
        rtt_[Index(u, v)] = std::max(forward.rtt_s, backward.rtt_s);
      }
    }
  }

  int workers() const { return n_; }
  int layers() const { return layers_; }
  int codecs() const { return static_cast<int>(codecs_.size()); }
  const CodecCost& codec(int c) const { return codecs_[c]; }
  const PlannerInput& input() const { return in_; }

  double Compute(int w, int begin, int end) const { return prefix_[w][end] - prefix_[w][begin]; }
  double Prefix(int w, int j) const { return prefix_[w][j]; }
  int LowestStart(int w, int end) const { return lowest_start_[w][end]; }
  double CutBytes(int j) const { return cut_bytes_[j]; }
  double CodecWork(int c, int j) const { return codecs_[c].seconds_per_byte * cut_bytes_[j]; }
  // One microbatch over the link u -> v with codec c at cut j, where u
  // carries `u_links` pipeline links in all (1 at an end of the pipeline,
  // 2 in the middle) and v `v_links`: the pair's rate, or each end's equal
  // share of its access link where that is less.
  double Transfer(int u, int v, int c, int j, int u_links, int v_links) const {
    const double rate = LinkRate(u, v, u_links, v_links);
    if (rate <= 0) return kInf;
    return cut_bytes_[j] * codecs_[c].ratio * 8.0 / rate;
  }
  double LinkRate(int u, int v, int u_links, int v_links) const {
    return std::min({rate_[Index(u, v)], access_[u] / std::max(1, u_links),
                     access_[v] / std::max(1, v_links)});
  }
  double Rtt(int u, int v) const { return rtt_[Index(u, v)]; }
  // The pair's own rate (what a probe between the two measured).
  double Rate(int u, int v) const { return rate_[Index(u, v)]; }
  double Access(int w) const { return access_[w]; }
  uint64_t MemoryOf(int begin, int end) const { return memory_prefix_[end] - memory_prefix_[begin]; }
  double ParameterBytes(int begin, int end) const {
    return static_cast<double>(parameter_prefix_[end] - parameter_prefix_[begin]);
  }

  double SumRtt(const std::vector<int>& order) const {
    double sum = 0;
    for (size_t k = 1; k < order.size(); ++k) sum += Rtt(order[k - 1], order[k]);
    return sum;
  }

  // W and the objective for a pipeline of `stages` stages with bottleneck
  // `tau`, RTTs summing to `sum_rtt` and a microbatch's round trip `trip`
  // (every stage's compute, every link both ways, the RTTs).
  double Objective(double tau, int stages, double sum_rtt, double trip,
                   int* in_flight = nullptr, double* round_trip = nullptr) const {
    const double batch = std::max(1, in_.microbatch_size);
    if (round_trip != nullptr) *round_trip = trip;
    if (in_.schedule == PlannerSchedule::kSync) {
      const int m = std::max(1, in_.microbatches);
      if (in_flight != nullptr) *in_flight = m;
      return ((m + stages - 1) * tau + sum_rtt) / (m * batch);
    }
    // Bounded as a double first: a tiny tau against a long trip must not
    // overflow the int.
    int window =
        tau > 0 ? static_cast<int>(std::min(std::ceil(trip / tau - 1e-9), 1e6)) : stages;
    window = std::max(window, stages);
    double effective = tau;
    if (in_.max_in_flight > 0 && window > in_.max_in_flight) {
      window = in_.max_in_flight;
      effective = std::max(tau, trip / window);
    }
    if (in_flight != nullptr) *in_flight = window;
    return effective / batch;
  }

  // The largest bottleneck with which a pipeline of at least `stages` stages
  // whose RTTs sum to at least `sum_rtt` could still reach `objective`.
  double TauBound(double objective, int stages, double sum_rtt) const {
    if (!std::isfinite(objective)) return kInf;
    const double batch = std::max(1, in_.microbatch_size);
    double tau;
    if (in_.schedule == PlannerSchedule::kSync) {
      const int m = std::max(1, in_.microbatches);
      tau = (objective * m * batch - sum_rtt) / (m + stages - 1);
    } else {
      tau = objective * batch;
      // A round trip holds T* at least once besides the RTTs.
      if (in_.max_in_flight > 0) {
        tau = std::min(tau, objective * batch * in_.max_in_flight - sum_rtt);
      }
    }
    return tau * (1 - kStrictlyBetter);
  }

 private:
  size_t Index(int u, int v) const { return static_cast<size_t>(u) * n_ + v; }

  const PlannerInput& in_;
  int n_ = 0;
  int layers_ = 0;
  std::vector<CodecCost> codecs_;
  std::vector<std::vector<double>> prefix_;
  std::vector<uint64_t> memory_prefix_;
  std::vector<uint64_t> parameter_prefix_;
  std::vector<double> cut_bytes_;
  std::vector<std::vector<int>> lowest_start_;
  std::vector<double> rate_;
  std::vector<double> rtt_;
  std::vector<double> access_;  // per worker, bits/s; kInf: not limited
};

// How many pipeline links stage k of `stages` carries: one at either end,
// two in the middle (none for a single stage).
int LinksOfStage(int k, int stages) { return (k > 0 ? 1 : 0) + (k + 1 < stages ? 1 : 0); }

// The feasibility sweep: can the stages of an order cover the layers with
// every stage and link within `tau`? Per stage O(layers x codecs). And the
// least round trip within `tau` (MinTrip), per stage O(layers^2 x codecs^2).
class Sweep {
 public:
  explicit Sweep(const CostModel& model) : model_(model) {}

  // start[i]: codec work a stage starting at cut i already carries (its
  // incoming link's share); kInf: it cannot start there. Fills end[j], the
  // least time of the stage on `w` ending at j before its outgoing link's
  // work, and from[j], where that stage starts.
  void StageEnds(int w, const std::vector<double>& start, double tau, std::vector<double>* end,
                 std::vector<int>* from) const {
    const int layers = model_.layers();
    end->assign(layers + 1, kInf);
    if (from != nullptr) from->assign(layers + 1, -1);
    std::deque<int> window;  // starts i, increasing start[i] - Prefix(w, i)
    auto key = [&](int i) { return start[i] - model_.Prefix(w, i); };
    for (int j = 1; j <= layers; ++j) {
      const int i = j - 1;
      if (start[i] < kInf) {
        while (!window.empty() && key(window.back()) >= key(i)) window.pop_back();
        window.push_back(i);
      }
      const int lowest = model_.LowestStart(w, j);
      while (!window.empty() && window.front() < lowest) window.pop_front();
      if (window.empty()) continue;
      const double t = model_.Prefix(w, j) + key(window.front());
      if (t <= tau) {
        (*end)[j] = t;
        if (from != nullptr) (*from)[j] = window.front();
      }
    }
  }

  // The next stage's starts over the link w -> v: the least codec work among
  // the codecs that keep both the ending stage and the link within tau.
  // Returns whether any start is possible.
  // `w_links` and `v_links`: the pipeline links each end carries
  // (CostModel::Transfer).
  bool NextStarts(int w, int v, int w_links, int v_links, const std::vector<double>& end,
                  double tau, std::vector<double>* start, std::vector<int>* codec) const {
    const int layers = model_.layers();
    start->assign(layers + 1, kInf);
    if (codec != nullptr) codec->assign(layers + 1, -1);
    bool any = false;
    for (int j = 1; j < layers; ++j) {
      if (end[j] == kInf) continue;
      for (int c = 0; c < model_.codecs(); ++c) {
        const double work = model_.CodecWork(c, j);
        if (work >= (*start)[j] || end[j] + work > tau) continue;
        if (model_.Transfer(w, v, c, j, w_links, v_links) > tau) continue;
        (*start)[j] = work;
        if (codec != nullptr) (*codec)[j] = c;
        any = true;
      }
    }
    return any;
  }

  // Whether `order` fits within tau; if so and `plan` is given, the cuts and
  // codecs of one such pipeline.
  bool Feasible(const std::vector<int>& order, double tau, PipelinePlan* plan) {
    ++sweeps_;
    const int stages = static_cast<int>(order.size());
    const int layers = model_.layers();
    if (stages == 0 || stages > layers) return false;
    from_.resize(stages);
    codec_.resize(stages);
    std::vector<double>& start = start_;
    start.assign(layers + 1, kInf);
    start[0] = 0;
    for (int k = 0; k < stages; ++k) {
      StageEnds(order[k], start, tau, &end_, &from_[k]);
      if (k + 1 == stages) break;
      if (!NextStarts(order[k], order[k + 1], LinksOfStage(k, stages),
                      LinksOfStage(k + 1, stages), end_, tau, &start, &codec_[k + 1])) {
        return false;
      }
    }
    if (end_[layers] == kInf) return false;
    if (plan == nullptr) return true;
    plan->stages.assign(stages, {});
    plan->links.assign(stages - 1, {});
    int j = layers;
    for (int k = stages - 1; k >= 0; --k) {
      const int i = from_[k][j];
      plan->stages[k].worker = order[k];
      plan->stages[k].layer_begin = i;
      plan->stages[k].layer_end = j;
      if (k > 0) plan->links[k - 1].codec_index = codec_[k][i];
      j = i;
    }
    return true;
  }

  // The least round trip (every stage's compute and codec work, every link
  // both ways and its RTT) among the cuts and codecs of `order` that keep
  // every stage and link within tau; kInf when none does. With `plan`, the
  // cuts and codecs of one such pipeline. O(stages x layers^2 x codecs^2);
  // counts as layers x codecs sweeps (what it costs against Feasible).
  double MinTrip(const std::vector<int>& order, double tau, PipelinePlan* plan) {
    const int stages = static_cast<int>(order.size());
    const int layers = model_.layers();
    const int codecs = model_.codecs();
    sweeps_ += static_cast<int64_t>(layers) * codecs;
    if (stages == 0 || stages > layers) return kInf;
    // trip[k][i * codecs + c]: the least trip of the stages and links before
    // stage k, stage k starting at cut i behind a link with codec c (stage
    // 0: c = 0, no codec work); from[k][...]: stage k - 1's state.
    const size_t states = static_cast<size_t>(layers + 1) * codecs;
    std::vector<std::vector<double>>& trip = trip_;
    std::vector<std::vector<size_t>>& from = trip_from_;
    trip.resize(stages);
    from.resize(stages);
    for (int k = 0; k < stages; ++k) {
      trip[k].assign(states, kInf);
      from[k].assign(states, 0);
    }
    trip[0][0] = 0;
    double best = kInf;
    size_t best_state = 0;
    for (int k = 0; k < stages; ++k) {
      const int w = order[k];
      const bool last = k + 1 == stages;
      for (int i = 0; i < layers; ++i) {
        for (int cin = 0; cin < codecs; ++cin) {
          const size_t state = static_cast<size_t>(i) * codecs + cin;
          const double before = trip[k][state];
          if (before == kInf) continue;
          const double in_work = k == 0 ? 0 : model_.CodecWork(cin, i);
          // Stage k ends early enough to leave each later stage a layer.
          const int last_end = layers - (stages - 1 - k);
          for (int j = last ? layers : i + 1; j <= last_end; ++j) {
            if (i < model_.LowestStart(w, j)) break;  // nor will it with more layers
            const double compute = model_.Compute(w, i, j) + in_work;
            if (compute > tau) break;  // grows with j
            if (last) {
              if (before + compute < best) {
                best = before + compute;
                best_state = state;
              }
              continue;
            }
            const int v = order[k + 1];
            for (int cout = 0; cout < codecs; ++cout) {
              const double stage = compute + model_.CodecWork(cout, j);
              const double transfer = model_.Transfer(w, v, cout, j, LinksOfStage(k, stages),
                                                      LinksOfStage(k + 1, stages));
              if (stage > tau || transfer > tau) continue;
              const double t = before + stage + 2 * transfer + model_.Rtt(w, v);
              const size_t next = static_cast<size_t>(j) * codecs + cout;
              if (t < trip[k + 1][next]) {
                trip[k + 1][next] = t;
                from[k + 1][next] = state;
              }
            }
          }
        }
      }
    }
    if (best == kInf || plan == nullptr) return best;
    plan->stages.assign(stages, {});
    plan->links.assign(stages - 1, {});
    size_t state = best_state;
    int end = layers;
    for (int k = stages - 1; k >= 0; --k) {
      const int begin = static_cast<int>(state / codecs);
      plan->stages[k].worker = order[k];
      plan->stages[k].layer_begin = begin;
      plan->stages[k].layer_end = end;
      if (k > 0) {
        plan->links[k - 1].codec_index = static_cast<int>(state % codecs);
        state = from[k][state];
      }
      end = begin;
    }
    return best;
  }

  // Feasibility sweeps run so far: the searches' measure of effort.
  int64_t sweeps() const { return sweeps_; }

 private:
  const CostModel& model_;
  int64_t sweeps_ = 0;
  std::vector<double> start_;
  std::vector<double> end_;
  std::vector<std::vector<int>> from_;
  std::vector<std::vector<int>> codec_;
  std::vector<std::vector<double>> trip_;
  std::vector<std::vector<size_t>> trip_from_;
};

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
  const double samples_per_round = static_cast<double>(std::max(1, in.outer_inner_steps)) *
                                   std::max(1, in.microbatches) *
                                   std::max(1, in.microbatch_size) * pipelines;
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
    std::string how;
    std::optional<PipelinePlan> best = PlanForWindow(input, &how);
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
        std::optional<PipelinePlan> narrower = PlanForWindow(capped, &capped_how);
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
  std::optional<PipelinePlan> PlanForWindow(const PlannerInput& input, std::string* how) const {
    CostModel model(input);
    const bool exhaustive = model.workers() <= options_.exhaustive_max_workers;
    std::optional<PipelinePlan> best = Search(input, exhaustive);
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
        std::optional<PipelinePlan> pipelines = Search(capped, exhaustive);
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
  std::optional<PipelinePlan> Search(const PlannerInput& input, bool exhaustive) const {
    CostModel model(input);
    Sweep sweep(model);
    Best best;
    Construct(model, &sweep, &best);
    if (exhaustive) {
      Exhaustive(model, &sweep, &best);
    } else {
      LocalSearch(model, &sweep, &best);
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
  void LocalSearch(const CostModel& model, Sweep* sweep, Best* best) const {
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
    while (sweep->sweeps() < budget) {
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
    expected_begin = s.layer_end;
  }
  if (expected_begin != layers) return absl::InvalidArgumentError("stages end before the last layer");
  plan->links.resize(plan->stages.size() - 1);
  for (PlannedLinkInfo& link : plan->links) {
    if (link.codec_index < 0 || link.codec_index >= model.codecs()) link.codec_index = 0;
  }
  Score(model, plan);
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
