// Online re-planning: whether to leave a working plan for a better one. The
// planner is re-run on fresh figures (link matrix, layer timings, members)
// every `check_interval`; this policy compares its prediction with the
// current plan's, re-scored on the same figures, and switches only when the
// gain is worth the move (Petals rebalances below 0.75 of optimal; here the
// threshold, the payback horizon and the interval are options). Pure: the
// caller passes the time. Thread-compatible.
#ifndef GEOTRAIN_COORDINATOR_REPLAN_POLICY_H_
#define GEOTRAIN_COORDINATOR_REPLAN_POLICY_H_

#include <cstdint>
#include <string>

namespace geotrain {

struct ReplanPolicyOptions {
  double min_gain = 0.20;                  // predicted speed-up needed (20%)
  int64_t payback_horizon_ms = 10 * 60 * 1000;  // the move must pay back within
  int64_t min_interval_ms = 2 * 60 * 1000;      // between voluntary re-plans
  int64_t check_interval_ms = 30 * 1000;        // how often to look
  int64_t fresh_recheck_ms = 1000;  // how soon to look again while waiting for checkpoints
};

struct ReplanCandidate {
  double current_s_per_sample = 0;  // the current plan, re-scored on fresh figures
  double best_s_per_sample = 0;     // the planner's best on the same figures
  double measured_s_per_sample = 0; // from the last steps (0: unknown)
  double move_bytes = 0;            // model state that changes workers
  double move_rate_bps = 0;         // the rate it would move at (0: unknown)
  // The moved layers' newest checkpoints are at most a step old, so the
  // move loses at most one step's update of those layers.
  bool state_fresh = true;
};

struct ReplanDecision {
  enum class Verdict { kNotDue, kKeep, kDefer, kSwitch };
  Verdict verdict = Verdict::kNotDue;
  std::string reason;  // with the numbers; empty when not due
};

class ReplanPolicy {
 public:
  explicit ReplanPolicy(ReplanPolicyOptions options = {}) : options_(options) {}

  // Whether a check is due (every check_interval).
  bool Due(int64_t now_ms) const { return now_ms - last_check_ms_ >= options_.check_interval_ms; }
  // The check is under way (also done by Decide): the next is due a whole
  // interval later even if this one finds nothing to decide.
  void MarkChecked(int64_t now_ms) { last_check_ms_ = now_ms; }
  // Decides on `candidate` (marks the check done). kSwitch: the caller
  // publishes the best plan and calls Switched().
  ReplanDecision Decide(const ReplanCandidate& candidate, int64_t now_ms);
  // A plan was published (voluntarily or not): the interval starts again.
  void Switched(int64_t now_ms) { last_switch_ms_ = now_ms; }

 private:
  const ReplanPolicyOptions options_;
  int64_t last_check_ms_ = INT64_MIN / 2;
  int64_t last_switch_ms_ = INT64_MIN / 2;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_REPLAN_POLICY_H_
