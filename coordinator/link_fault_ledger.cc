#include "coordinator/link_fault_ledger.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace geotrain {

void LinkFaultLedger::Forget(int64_t now_ms) {
  while (!incidents_.empty() &&
         (now_ms - incidents_.front().at_ms > window_ms_ || incidents_.size() > kMaxIncidents)) {
    incidents_.pop_front();
  }
}

int LinkFaultLedger::CountFor(const std::string& worker_id, int64_t now_ms) const {
  int n = 0;
  for (const Incident& i : incidents_) {
    if (now_ms - i.at_ms <= window_ms_ && (i.a == worker_id || i.b == worker_id)) ++n;
  }
  return n;
}

std::optional<LinkFaultLedger::Verdict> LinkFaultLedger::Report(const std::string& reporter,
                                                                const std::string& accused,
                                                                uint64_t epoch, int64_t now_ms) {
  Forget(now_ms);
  const std::string& a = std::min(reporter, accused);
  const std::string& b = std::max(reporter, accused);
  for (const Incident& i : incidents_) {
    if (i.a == a && i.b == b && i.epoch == epoch) return std::nullopt;
  }
  const bool pair_broke_before = std::any_of(
      incidents_.begin(), incidents_.end(), [&](const Incident& i) { return i.a == a && i.b == b; });
  incidents_.push_back({a, b, epoch, now_ms});
  if (excluded_.size() > kMaxIncidents) excluded_.clear();
  const int by_reporter = CountFor(reporter, now_ms);
  const int by_accused = CountFor(accused, now_ms);
  Verdict verdict;
  const int most = std::max(by_reporter, by_accused);
  if (by_reporter != by_accused) {
    verdict.take_out = by_reporter > by_accused ? reporter : accused;
    verdict.exclude = most >= kIncidentsToExclude;
  } else if (pair_broke_before) {
    // The same two again with even records: the accused left last time,
    // so the reporter leaves now, for good (the pair cannot be told apart,
    // and it must not churn the plan one epoch after another).
    verdict.take_out = reporter;
    verdict.exclude = true;
    excluded_[reporter] = now_ms;
  } else {
    verdict.take_out = accused;
  }
  verdict.why = absl::StrCat("the link ", reporter, " - ", accused, " broke (epoch ", epoch,
                             "); in the last ", window_ms_ / 1000, " s ", reporter, " was in ",
                             by_reporter, " broken links, ", accused, " in ", by_accused);
  return verdict;
}

std::optional<std::string> LinkFaultLedger::ExclusionOf(const std::string& worker_id,
                                                        int64_t now_ms) const {
  const int mine = CountFor(worker_id, now_ms);
  if (mine < kIncidentsToExclude) return std::nullopt;
  if (auto it = excluded_.find(worker_id); it != excluded_.end() && now_ms - it->second <= window_ms_) {
    return absl::StrCat("in ", mine, " broken links in the last ", window_ms_ / 1000,
                        " s, the same link broken again");
  }
  // Excluded while it has more incidents than the other end of its newest.
  for (auto it = incidents_.rbegin(); it != incidents_.rend(); ++it) {
    if (now_ms - it->at_ms > window_ms_) break;
    if (it->a != worker_id && it->b != worker_id) continue;
    const std::string& other = it->a == worker_id ? it->b : it->a;
    if (mine > CountFor(other, now_ms)) {
      return absl::StrCat("in ", mine, " broken links in the last ", window_ms_ / 1000,
                          " s, more than its neighbours");
    }
    return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace geotrain
