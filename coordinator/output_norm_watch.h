// The cheap check on every microbatch (docs/verification.md, issue 35): the
// size of each worker's activations and gradients, as its neighbours
// measured them on the bytes they received (LinkStats.received_rms, one
// figure per link in every heartbeat). A worker whose outputs are far from
// those of the same stage in the other pipelines, or from its own history,
// becomes a suspect: its computations are to be audited more often.
// Suspicion is not a verdict; only an audit evicts.
//
// Figures are per sampled step (LinkStats.received_rms_by_step): the same
// step's in every pipeline, so replicas are compared at the same point of
// training, never at whatever moments their receivers' heartbeats caught
// (early in a run activations grow several-fold within a second, and a
// figure a heartbeat older made an honest worker a suspect).
//
// "Its replicas'" is the median of the stage's senders at that step, itself
// included, when there are three or more (one outlier cannot move it far),
// and the other one's figure when there are two; nothing until every
// worker the plan puts on the stage has a figure for the step.
//
// With two pipelines a stage has one other replica, and a pair that
// diverges makes both suspects: nothing in the norms says which one lies.
// Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_OUTPUT_NORM_WATCH_H_
#define GEOTRAIN_COORDINATOR_OUTPUT_NORM_WATCH_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct OutputNormWatchOptions {
  // A sender's RMS this many times the median of its replicas' (or this
  // many times smaller) at the same step is an outlier. Honest replicas of
  // the demo GPT differ by a few percent on activations and tens of
  // percent on gradients.
  double replica_ratio = 3.0;
  // The same against its own history: the range of its last
  // `history_window` judged figures (one a judged sampled step, 8 steps
  // apart or more) taken while it was no suspect. A sudden jump is caught;
  // the drift of honest training is not (the demo GPT's gradients move 20x
  // over a run, gradually: a slow average of them made suspects of honest
  // workers).
  double history_ratio = 3.0;
  size_t history_window = 10;
  size_t min_history = 5;
  // Sampled steps kept per sender (its receivers report their newest 16).
  size_t kept_samples = 64;
};

// One kind of output of one worker, as its receivers measured it.
struct OutputNorms {
  std::string worker_id;
  std::string kind;  // "activation" or "gradient"
  int stage = -1;
  int step = -1;            // the step last judged at; -1: none yet
  double rms = 0;           // at that step (before it: the newest figure)
  double replicas_rms = 0;  // what it is compared with (see the file comment); 0: none
  double history_rms = 0;   // the mean of its history; 0: too little
  std::string suspicion;    // why it is a suspect; empty: it is not
};

class OutputNormWatch {
 public:
  explicit OutputNormWatch(OutputNormWatchOptions options = {});

  // `receiver`'s link figures, attributed through `plan` to the workers
  // that sent them; `receiver_epoch` is the plan epoch the receiver runs
  // (figures measured under another plan are not attributed through this
  // one). Each stage is judged at the newest sampled step every worker the
  // plan puts on it has a figure for, once per step. Returns the outputs
  // that became suspect, and those that stopped being (suspicion empty),
  // for events.
  std::vector<OutputNorms> Record(const v1::Plan& plan, const std::string& receiver,
                                  uint64_t receiver_epoch, const v1::StageStats& stats);

  // The worker's figures (activation, gradient; either may be missing).
  std::vector<OutputNorms> NormsOf(const std::string& worker_id) const;
  // Its suspicions, "; "-joined; empty when none.
  std::string SuspicionOf(const std::string& worker_id) const;
  // A worker that left: its figures are forgotten.
  void Forget(const std::string& worker_id);

 private:
  struct Sample {
    double rms = 0;
    uint32_t messages = 0;
  };
  struct Figure {
    int stage = -1;
    int stage_workers = 0;  // the plan's workers on that stage
    uint64_t epoch = 0;     // of the plan it was attributed through
    std::string receiver;   // who measured it
    std::map<int, Sample> samples;  // by step, the newest kept_samples
    std::deque<double> history;     // its last judged figures while no suspect
    int judged_step = -1;
    double judged_rms = 0;
    double judged_replicas_rms = 0;
    std::string suspicion;
  };
  using Key = std::pair<std::string, std::string>;  // worker, kind
  // A stage's senders of one kind under one plan, judged together.
  using Group = std::tuple<std::string, int, uint64_t>;  // kind, stage, epoch

  // Judges every sender of `group` at the newest step all of them have
  // figures for, if it is later than the group's last; appends changes.
  void JudgeGroupLocked(const Group& group, std::vector<OutputNorms>* changed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  OutputNorms NormsLocked(const Key& key, const Figure& figure) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const OutputNormWatchOptions options_;
  mutable absl::Mutex mu_;
  std::map<Key, Figure> figures_ ABSL_GUARDED_BY(mu_);
  std::map<Group, int> judged_steps_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_OUTPUT_NORM_WATCH_H_
