// Loss jumps attributed to the stages that fed them (docs/verification.md,
// issue 35). With several pipelines each one's last stage reports its own
// loss every step; a pipeline whose loss leaves the others', or jumps
// against its own recent losses, has a worker that computed something
// wrong somewhere along it, and every worker of the pipeline is audited at
// the suspect's rate until its loss is back. Which one is the spot checks'
// to find: the loss says only which pipeline.
//
// A pipeline is a suspect when its newest loss is
// - `others_ratio` times the median of the other pipelines' newest losses
//   (with three pipelines or more; two cannot say which of them is off),
//   or
// - `history_ratio` times the largest of its own last `history_window`
//   losses (taken while it was no suspect), once it has `min_history`.
// Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_LOSS_JUMP_WATCH_H_
#define GEOTRAIN_COORDINATOR_LOSS_JUMP_WATCH_H_

#include <cstddef>
#include <deque>
#include <map>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace geotrain {

struct LossJumpWatchOptions {
  // Honest pipelines of test_pipelines' job differ by tens of percent from
  // step to step; a sign-flipped gradient doubles the loss within steps.
  double others_ratio = 2.0;
  double history_ratio = 2.0;
  size_t history_window = 20;
  size_t min_history = 10;
};

class LossJumpWatch {
 public:
  explicit LossJumpWatch(LossJumpWatchOptions options = {}) : options_(options) {}

  // Pipeline `pipeline`'s loss of one step. Returns the pipeline's
  // suspicion when it changed: a reason when it became a suspect, "" when
  // it ceased to be one; nullopt when nothing changed.
  std::optional<std::string> Record(int pipeline, double loss);
  // Why `pipeline` is a suspect ("": it is not).
  std::string SuspicionOf(int pipeline) const;

 private:
  struct Figures {
    double newest = 0;
    bool has_newest = false;
    std::deque<double> history;  // while no suspect, oldest first
    std::string suspicion;
  };
  std::string JudgeLocked(int pipeline) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LossJumpWatchOptions options_;
  mutable absl::Mutex mu_;
  std::map<int, Figures> pipelines_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_LOSS_JUMP_WATCH_H_
