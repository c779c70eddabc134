#include "coordinator/replan_policy.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace geotrain {

ReplanDecision ReplanPolicy::Decide(const ReplanCandidate& c, int64_t now_ms) {
  ReplanDecision decision;
  last_check_ms_ = now_ms;
  if (!(c.best_s_per_sample > 0) || !(c.current_s_per_sample > 0)) {
    decision.verdict = ReplanDecision::Verdict::kKeep;
    decision.reason = "no prediction to compare";
    return decision;
  }
  const double gain = c.current_s_per_sample / c.best_s_per_sample - 1;
  std::string numbers = absl::StrFormat(
      "current plan %.3f ms/sample predicted on fresh figures%s, best %.3f (%+.0f%%)",
      1e3 * c.current_s_per_sample,
      c.measured_s_per_sample > 0
          ? absl::StrFormat(" (measured %.3f)", 1e3 * c.measured_s_per_sample)
          : std::string(),
      1e3 * c.best_s_per_sample, 100 * gain);
  if (gain < options_.min_gain) {
    decision.verdict = ReplanDecision::Verdict::kKeep;
    decision.reason = absl::StrFormat("keep: %s, under the %.0f%% threshold", numbers,
                                      100 * options_.min_gain);
    return decision;
  }
  // Time the move takes, against the time it saves over the horizon.
  const double move_s = c.move_bytes <= 0 ? 0
                        : c.move_rate_bps > 0 ? c.move_bytes * 8 / c.move_rate_bps
                                              : 1e9;
  const double saved_fraction = 1 - c.best_s_per_sample / c.current_s_per_sample;
  const double horizon_s = options_.payback_horizon_ms / 1000.0;
  const double payback_s = saved_fraction > 0 ? move_s / saved_fraction : 1e18;
  absl::StrAppendFormat(&numbers, "; moving %.1f MiB takes %.1f s, paid back in %.0f s",
                        c.move_bytes / (1 << 20), move_s, payback_s);
  if (payback_s > horizon_s) {
    decision.verdict = ReplanDecision::Verdict::kKeep;
    decision.reason = absl::StrFormat("keep: %s, beyond the %.0f s horizon", numbers, horizon_s);
    return decision;
  }
  if (now_ms - last_switch_ms_ < options_.min_interval_ms) {
    decision.verdict = ReplanDecision::Verdict::kDefer;
    decision.reason = absl::StrFormat("defer: %s; the last re-plan was %.0f s ago (at most one per %.0f s)",
                                      numbers, (now_ms - last_switch_ms_) / 1000.0,
                                      options_.min_interval_ms / 1000.0);
    return decision;
  }
  if (!c.state_fresh) {
    // Checkpoints land every few steps: look again in a second rather than
    // in a whole check interval, or the moment may be missed every time.
    last_check_ms_ = now_ms - options_.check_interval_ms + options_.fresh_recheck_ms;
    decision.verdict = ReplanDecision::Verdict::kDefer;
    decision.reason = absl::StrFormat(
        "defer: %s; waiting for the moved layers' next checkpoints (so that at most one "
        "step of their updates is lost)",
        numbers);
    return decision;
  }
  decision.verdict = ReplanDecision::Verdict::kSwitch;
  decision.reason = absl::StrFormat("switch: %s", numbers);
  return decision;
}

}  // namespace geotrain
