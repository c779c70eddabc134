// Planner v2: chooses which workers form the pipeline and in what order, the
// layer cuts, the codec of every link and the in-flight window together, by
// the predicted time per sample (T* in DESIGN.md, with latency and sync's
// flush). Inputs are plain figures (measured where the coordinator has
// measurements, assumed otherwise), so the planners are pure functions:
// thread-compatible, deterministic for the same inputs, no clock.
//
// The cost model, per microbatch of `microbatch_size` samples:
// - stage compute c_k: the stage's layers on its worker (measured seconds
//   per sample for the layer's kind when the worker has one, FLOPs / GFLOP/s
//   otherwise), plus the codec work of its links (each end encodes one
//   direction and decodes the other: ratio-independent cost per raw byte);
// - link time l_k: raw bytes at the cut x the codec's ratio / rate, the
//   slower of the two directions (activations down, gradients up), where
//   the rate is the pair's, or less where an end's access link is shared
//   (its uplink or downlink, PlannerWorkerInfo, split equally among the
//   links of that end: one at the pipeline's ends, two in the middle);
// - T* = max over stages and links;
// - the round trip: one microbatch through every stage (compute and codec
//   work) and over every link both ways, plus the RTTs;
// - async: W = max(p, ceil(round trip / T*)); a cap on W below that
//   stretches T* to round trip / W, so where a cap binds a stronger codec
//   pays even on a link faster than the stages (its transfer is on the
//   round trip);
// - sync: a step of M microbatches takes (M + p - 1) T* + sum of RTTs.
// The objective is that per-microbatch time divided by microbatch_size.
#ifndef GEOTRAIN_COORDINATOR_NETWORK_PLANNER_H_
#define GEOTRAIN_COORDINATOR_NETWORK_PLANNER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace geotrain {

// One direction of a pair of workers.
struct LinkEstimate {
  double rtt_s = 0;
  double rate_bps = 0;  // bits per second; 0: unknown (the default is used)
};

struct PlannerWorkerInfo {
  std::string id;
  std::string name;  // for explanations; id when empty
  double gflops = 0;  // used for layer kinds without a measured time
  // Forward + backward seconds per sample of one layer of each kind, as the
  // worker measured them on its device with the job's microbatch shape.
  std::map<std::string, double> seconds_per_sample;
  uint64_t memory_bytes = 0;  // 0: unknown, not limited
  // The worker's access link (its port: a home connection, a VM's NIC),
  // bits per second each way; 0: unknown, not limited beyond the pairs'
  // rates. Every link of the worker's crosses it: a middle stage's
  // activations out and gradients out share its uplink, and what comes in
  // shares its downlink. The planner gives each link an equal share (what
  // TCP's flows on one bottleneck get), so a stage with two links sees half
  // its port on each.
  double uplink_bps = 0;
  double downlink_bps = 0;
  bool reachable = true;
  // False for a worker that may hold a stage but not become a replica (a
  // demoted straggler, or one whose replica was lost a moment ago).
  bool may_replicate = true;
};

struct PlannerLayer {
  std::string kind;               // e.g. "embed", "block", "head", "linear"
  double flops_per_sample = 0;    // forward + backward
  uint64_t training_bytes = 0;    // what a stage holds to train it
  // Bytes per sample of the activation leaving this layer (the gradient
  // coming back has the same size). Unused for the last layer.
  uint64_t output_bytes_per_sample = 0;
  uint64_t parameter_bytes = 0;   // the weights (what replicas average)
};

struct CodecCost {
  int codec = 0;           // a v1::Codec value
  std::string name;
  double ratio = 1;        // wire bytes / raw bytes
  double seconds_per_byte = 0;  // encode + decode of one raw byte
};

enum class PlannerSchedule { kSync, kAsync };

struct PlannerInput {
  std::vector<PlannerWorkerInfo> workers;  // in join order
  // links[i * workers.size() + j]: from workers[i] to workers[j]. An entry
  // with rate 0 takes the reverse direction's figures, or default_link.
  std::vector<LinkEstimate> links;
  LinkEstimate default_link{0.0002, 1e9};
  std::vector<PlannerLayer> layers;
  // The codecs a link may use; empty means raw only. The first is the
  // cheapest to run (normally none).
  std::vector<CodecCost> codecs;
  PlannerSchedule schedule = PlannerSchedule::kAsync;
  int microbatches = 1;  // per step (sync's flush)
  int microbatch_size = 1;
  int max_stages = 0;     // 0: no limit but the workers and layers
  int max_in_flight = 0;  // 0: no cap on W
  // Async schedules: the loss per sample that each microbatch in flight
  // beyond one per stage costs (one more weight version of staleness), as a
  // fraction; the planner takes a narrower window where the samples/s it
  // gives up cost less. 0: W covers the round trip whatever it costs.
  double staleness_cost = 0;
  // Replicas (job.replicas): at most this many workers per stage but the last,
  // the primary included; 1: none. A spare becomes a replica where that
  // lowers the objective (the router splits microbatches by speed; the
  // stage's workers average their weights every replica_sync_every steps,
  // each sending them at replica_ratio wire bytes per byte).
  int max_replicas = 1;
  int replica_sync_every = 5;
  double replica_ratio = 0.5;
  // Pipelines (job.outer): at most this many full pipelines; 1: one, 0: no
  // cap. Join order makes as many as the workers fill; the network planner
  // adds them (at pipeline 0's cuts, of the fastest spares) while each
  // lowers the job's time per sample by more than 1%, and then makes no
  // replicas within a pipeline. The outer step sends each stage's
  // pseudo-gradients at outer_ratio wire bytes per weight byte every
  // outer_inner_steps steps.
  int max_pipelines = 1;
  int outer_inner_steps = 50;
  // OuterOptimizer.split_batch: a round is outer_inner_steps steps of the
  // job's batch, whatever R (not R times it).
  bool outer_split_batch = false;
  double outer_ratio = 0.25;

  LinkEstimate Link(int from, int to) const;
};

struct PlannedStageInfo {
  int worker = 0;  // index into PlannerInput::workers
  int layer_begin = 0;
  int layer_end = 0;
  // Middle stages: more workers running the same layers (indices into
  // PlannerInput::workers).
  std::vector<int> replicas;
  // With pipelines: the stage's worker in pipeline 1, 2, ... (`worker` is
  // pipeline 0's).
  std::vector<int> pipeline_workers;
  // Per microbatch, codec work and (with replicas) the stage's combined
  // pace and its share of weight averaging included.
  double compute_s = 0;
  std::string why;       // the reason the worker is here
};

// The link from stage k to stage k + 1.
struct PlannedLinkInfo {
  int codec_index = -1;  // into PlannerInput::codecs; -1: raw (no ladder)
  double raw_bytes = 0;  // per microbatch, each direction
  double transfer_s = 0; // per microbatch, the slower direction, after the codec
  double rtt_s = 0;
};

struct PipelinePlan {
  // R full pipelines of these stages (PlannedStageInfo::pipeline_workers).
  int pipelines = 1;
  std::vector<PlannedStageInfo> stages;
  std::vector<PlannedLinkInfo> links;  // stages.size() - 1
  std::vector<int> spares;             // workers outside the pipeline
  int in_flight = 1;                   // W (async)
  double bottleneck_s = 0;             // T*, per microbatch
  double round_trip_s = 0;
  double time_per_sample_s = 0;        // the objective (what plans are ranked by)
  // What a sample should take: async, the objective; sync, per step of M
  // microbatches (M - 1) T* plus one microbatch's trip through every stage
  // and over every link both ways, plus the RTTs (a flushed step fills and
  // drains the pipeline once: more than (p - 1) T* where links are slow).
  double predicted_s_per_sample = 0;
  std::string bound;                   // what sets T*
  std::string planner;                 // which planner chose it
  bool exact = false;                  // the search was exhaustive
};

class Planner {
 public:
  virtual ~Planner() = default;
  virtual std::string name() const = 0;
  // RESOURCE_EXHAUSTED when no pipeline fits the workers' memory;
  // INVALID_ARGUMENT / FAILED_PRECONDITION for empty inputs.
  virtual absl::StatusOr<PipelinePlan> Plan(const PlannerInput& input) const = 0;
};

struct NetworkPlannerOptions {
  // Up to this many workers every order of every subset is searched (with
  // bounds that never cut off a better plan): the result is optimal.
  int exhaustive_max_workers = 8;
  // Above it, a local search from several constructions; its effort in
  // feasibility sweeps is this divided by (stages x layers x codecs),
  // within [min, max]. Counted, not timed, so results repeat.
  double search_work = 2e8;
  int min_search_evaluations = 300;
  int max_search_evaluations = 20000;
  // Wall time for all of one Plan()'s local searches (a share each); 0:
  // none. The coordinator plans under its plan lock: at a thousand
  // members the counted effort alone took 2.6 s here. Plans repeat exactly
  // only where the count, not the clock, ends the search.
  absl::Duration time_budget = absl::Milliseconds(1500);
};

// Today's planner (v1): the fastest min(workers, layers, max_stages) in join
// order, cuts balancing compute alone, every link raw.
// The stages of a `stages`-stage pipeline that may have replicas, in the
// order spares go to them: the middle stages, then stage 0 (whose replicas
// split the microbatch ids). Never the last, which owns the loss and the
// step count; none for a single stage.
std::vector<int> ReplicableStages(int stages);

std::unique_ptr<Planner> MakeJoinOrderPlanner();
std::unique_ptr<Planner> MakeNetworkPlanner(NetworkPlannerOptions options = {});

// The best cuts, codecs and window for a fixed order of workers (indices
// into input.workers, each given at least one layer), and its prediction.
absl::StatusOr<PipelinePlan> PlanForOrder(const PlannerInput& input,
                                          const std::vector<int>& order);

// Scores fixed cuts and codecs (stage worker/layer ranges, replicas and
// link codecs as given): fills compute, link times, W, T* and the objective.
// With plan->pipelines = R > 1, every stage names its worker in pipelines
// 1..R-1 (pipeline_workers), and the figures are the job's, as the planner
// gives them for R pipelines.
absl::Status ScorePlan(const PlannerInput& input, PipelinePlan* plan);

// What the network planner minimises: the plan's time per sample over its
// statistical efficiency, 1 + input.staleness_cost for each microbatch in
// flight beyond one per stage (async schedules).
double GoodputSecondsPerSample(const PlannerInput& input, const PipelinePlan& plan);

// Per stage: layers, worker, predicted compute, the link after it and the
// bound, with the reason each worker is where it is. Multi-line.
std::string ExplainPlan(const PlannerInput& input, const PipelinePlan& plan);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_NETWORK_PLANNER_H_
