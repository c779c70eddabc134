// Straggler detection over a snapshot of the stages' measured compute time
// per microbatch. No I/O and no clock of its own (it remembers only since
// when each stage has looked slow): the caller passes the figures and the
// time, and acts on the verdicts (swap a slow stage's worker for a standby, demote a slow
// replica). Thread-compatible.
//
// A stage is a straggler when it is far slower than every other stage
// (stage_factor) and its slowest worker has also slowed well below its own
// best pace on the same layers (slowdown_factor): the planner balanced the
// stages, so a stage slow from the start was given too much work, and
// another worker would not help. A replica far slower than its stage's
// fastest worker (stage_factor) only wastes what the router still sends it.
// Either must last a whole patience period before it is reported, and is
// reported again only after another.
#ifndef GEOTRAIN_COORDINATOR_STRAGGLER_DETECTOR_H_
#define GEOTRAIN_COORDINATOR_STRAGGLER_DETECTOR_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace geotrain {

struct StragglerOptions {
  double stage_factor = 3.0;
  double slowdown_factor = 2.0;
  int64_t patience_ms = 5000;
};

struct StageTimings {
  int layer_begin = 0, layer_end = 0;
  // Live workers of the stage with a measured compute time per microbatch
  // (seconds, > 0): the primary and its replicas.
  std::vector<std::pair<std::string, double>> workers;
};

struct StragglerVerdict {
  std::string worker_id;
  std::string reason;  // with the numbers and how long it lasted
  bool demote = false; // a replica slower than its siblings
};

class StragglerDetector {
 public:
  explicit StragglerDetector(StragglerOptions options = {}) : options_(options) {}

  // The workers that straggled for a whole patience period, in stage order.
  // Nothing while any stage has no figures yet.
  std::vector<StragglerVerdict> Check(const std::vector<StageTimings>& stages, int64_t now_ms);
  // A new plan: how long a worker has straggled starts again (its own best
  // pace is kept while its layers stay the same).
  void ResetPatience() { straggling_since_ms_.clear(); }
  // The fastest time per microbatch seen of `worker_id` on its current
  // layers (0: none yet).
  double BestPaceOf(const std::string& worker_id) const;

 private:
  struct Pace {
    int layer_begin = 0, layer_end = 0;
    double best_s = 0;
  };
  const StragglerOptions options_;
  std::map<std::string, Pace> pace_;
  std::map<std::string, int64_t> straggling_since_ms_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_STRAGGLER_DETECTOR_H_
