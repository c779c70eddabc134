// The cheap check on every microbatch (docs/verification.md, issue 35): the
// size of each worker's activations and gradients, as its neighbours
// measured them on the bytes they received (LinkStats.received_rms, one
// figure per link in every heartbeat). A worker whose outputs are far from
// those of the same stage in the other pipelines, or from its own history,
// becomes a suspect: its computations are to be audited more often.
// Suspicion is not a verdict; only an audit evicts.
//
// "Its replicas'" is the median of the stage's senders, itself included,
// when there are three or more (one outlier cannot move it far), and the
// other one's figure when there are two; nothing until every worker the
// plan puts on the stage has a figure.
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
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct OutputNormWatchOptions {
  // A sender's RMS this many times the median of its replicas' (or this
  // many times smaller) is an outlier. Honest replicas of the demo GPT
  // differ by a few percent on activations and tens of percent on
  // gradients.
  double replica_ratio = 3.0;
  // The same against its own history: the range of its last
  // `history_window` figures (one a heartbeat) taken while it was no
  // suspect. A sudden jump is caught; the drift of honest training is not
  // (the demo GPT's gradients move 20x over a run, gradually: a slow
  // average of them made suspects of honest workers).
  double history_ratio = 3.0;
  size_t history_window = 10;
  // Messages a receiver must have measured before its figure counts, and
  // figures before a sender's history does.
  uint64_t min_messages = 8;
  size_t min_history = 5;
};

// One kind of output of one worker, as its receivers measured it.
struct OutputNorms {
  std::string worker_id;
  std::string kind;  // "activation" or "gradient"
  int stage = -1;
  double rms = 0;
  double replicas_rms = 0;  // what it is compared with (see the file comment); 0: none
  double history_rms = 0;   // the mean of its history; 0: too little
  std::string suspicion;    // why it is a suspect; empty: it is not
};

class OutputNormWatch {
 public:
  explicit OutputNormWatch(OutputNormWatchOptions options = {});

  // `receiver`'s link figures, attributed through `plan` to the workers
  // that sent them. Returns the outputs that became suspect with this
  // report, and those that stopped being (suspicion empty), for events.
  std::vector<OutputNorms> Record(const v1::Plan& plan, const std::string& receiver,
                                  const v1::StageStats& stats);

  // The worker's figures (activation, gradient; either may be missing).
  std::vector<OutputNorms> NormsOf(const std::string& worker_id) const;
  // Its suspicions, "; "-joined; empty when none.
  std::string SuspicionOf(const std::string& worker_id) const;
  // A worker that left: its figures are forgotten.
  void Forget(const std::string& worker_id);

 private:
  struct Figure {
    int stage = -1;
    int stage_workers = 0;  // the plan's workers on that stage
    uint64_t epoch = 0;     // of the plan it was attributed through
    double rms = 0;
    std::deque<double> history;  // its last figures while no suspect
    std::string suspicion;
  };
  using Key = std::pair<std::string, std::string>;  // worker, kind

  // Re-judges `key` against its stage's other senders and its history.
  std::optional<OutputNorms> JudgeLocked(const Key& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  OutputNorms NormsLocked(const Key& key, const Figure& figure) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  double ReplicasMedianLocked(const Key& key, int stage) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const OutputNormWatchOptions options_;
  mutable absl::Mutex mu_;
  std::map<Key, Figure> figures_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_OUTPUT_NORM_WATCH_H_
