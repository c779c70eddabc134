// The network planner's cost model, shared by its searches
// (network_planner.cc) and its scoring and refinements (plan_cost_model.cc):
// CostModel's tables, the feasibility Sweep, and what turns a chosen order
// into a scored plan (cuts, codecs, replicas, pipelines, reasons). Internal
// to the planner: callers use network_planner.h.
#ifndef GEOTRAIN_COORDINATOR_PLAN_COST_MODEL_H_
#define GEOTRAIN_COORDINATOR_PLAN_COST_MODEL_H_

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/network_planner.h"
#include "coordinator/planner.h"

namespace geotrain {
namespace planner_internal {


inline constexpr double kInf = std::numeric_limits<double>::infinity();
// A plan must beat the incumbent by this fraction to replace it, so equal
// plans keep the first one found (deterministic) and bounds prune ties.
inline constexpr double kStrictlyBetter = 1e-9;

inline std::string NameOf(const PlannerWorkerInfo& w) { return w.name.empty() ? w.id : w.name; }

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
inline int LinksOfStage(int k, int stages) { return (k > 0 ? 1 : 0) + (k + 1 < stages ? 1 : 0); }

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

// The workers in no stage, replica or pipeline of `plan`.
void FillSpares(const CostModel& model, PipelinePlan* plan);

// Fills the figures of a plan whose workers, cuts, replicas and codecs are
// set. A replicated stage runs at its workers' combined pace plus its share
// of weight averaging (every worker sends the stage's weights once per
// replica_sync_every steps over the slowest link among them); a link into
// or out of one carries each pair's share of the microbatches, the pairs in
// parallel.
void Score(const CostModel& model, PipelinePlan* plan);

// Under the async schedules with a cap W on the window the objective is
// max(T*, round trip / W): where the cap binds, cuts and codecs with a larger
// T* but a shorter round trip (a stronger codec: more codec work, shorter
// transfers) can beat the least T*. g(tau) = MinTrip(tau) / W does not grow
// with tau, so the best plan sits where tau meets g: bisection between the
// least feasible tau (`plan`'s T*, where g is above) and a tau where g is
// below, keeping the best plan scored on the way.
void CoverTheRoundTrip(const CostModel& model, Sweep* sweep, const std::vector<int>& order,
                       PipelinePlan* plan);

// The least T* for a fixed order (bisection on tau over the sweep; each
// feasible tau is tightened to the plan's own T*), then, where a window cap
// binds, the least objective (CoverTheRoundTrip).
bool BestCuts(const CostModel& model, Sweep* sweep, const std::vector<int>& order,
              PipelinePlan* plan);

// Whether every worker of stage `s` holds its layers in memory.
bool StageFits(const CostModel& model, const PlannedStageInfo& s);

// Moves cuts one layer at a time while that lowers the objective (a stage
// that gained a replica can take layers from its neighbours). Codecs stay.
void ImproveCuts(const CostModel& model, PipelinePlan* plan);

// Replicas, after the search has fixed the pipeline: while making a spare a
// replica of a stage in ReplicableStages with room (max_replicas per stage) and
// then moving cuts lowers the objective by more than 1%, the best such move
// is taken. Per stage the spare tried is the fastest on its layers that
// fits (ties: the lower index). Greedy: the pipeline is the search's (exact
// up to 8 workers); which spares replicate it is not searched exhaustively.
void AddReplicas(const CostModel& model, PipelinePlan* plan);

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
                    PipelinePlan* plan);

// Pipeline 0 is `plan` (its figures as Score left them), `more` the others
// at the same cuts and codecs: the job's figures (ScoreOuterSync) and spares.
void ScorePipelines(const CostModel& model, const std::vector<PipelinePlan>& more,
                    PipelinePlan* plan);

// Pipelines (job.outer: max_pipelines 0, as many as pay, or a cap), after
// the search has fixed pipeline 0: while a further pipeline of spares at
// pipeline 0's cuts and codecs lowers the job's predicted time per sample
// by more than 1%, the outer sync's traffic counted (ScorePipelines), it is
// added. Greedy: a new pipeline's stages choose in order of pipeline 0's
// compute, heaviest first, each the spare fastest on its layers that holds
// them and may replicate; links and ports are then scored as they fall.
void AddPipelines(const CostModel& model, PipelinePlan* plan);

absl::Status Validate(const PlannerInput& input);

int StageLimit(const PlannerInput& input);

absl::Status NoFit(const CostModel& model, int stages);

// Reasons, after the search: what each worker brings where it is.
void Explain(const CostModel& model, PipelinePlan* plan, const std::string& how);

}  // namespace planner_internal
}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PLAN_COST_MODEL_H_
