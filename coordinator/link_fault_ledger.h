// The books on broken links between neighbouring workers, and whom each
// break takes out of the pipeline.
//
// A link that breaks is one incident involving both of its ends: the
// coordinator cannot tell which end broke it, and either end may lie about
// it (a worker can drop its links, or report a break that never happened).
// So no worker's word is trusted over its neighbour's; the record decides.
// Each incident takes one end out: the one involved in more incidents
// within the recent window, or on a tie the accused (the end the report
// names). A worker involved in at least kIncidentsToExclude incidents in
// the window, and in more than the other end of the latest one, is
// excluded: it gets no stage and is no standby until its incidents leave
// the window. The same pair broken again with even records takes out (and
// excludes) the reporter: the accused left the first time. A single bad worker (or a copy of its key, or a host whose
// network keeps failing) is then out after its second incident, whoever
// reports what; an honest neighbour of it is taken out at most once.
//
// One incident per link per plan epoch: both ends' reports of one break,
// or one end's repeated reports, count once. No I/O and no clock of its
// own (the caller passes the time). Thread-compatible.
#ifndef GEOTRAIN_COORDINATOR_LINK_FAULT_LEDGER_H_
#define GEOTRAIN_COORDINATOR_LINK_FAULT_LEDGER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>

namespace geotrain {

class LinkFaultLedger {
 public:
  static constexpr int kIncidentsToExclude = 2;
  static constexpr int kWindowLeases = 30;
  static constexpr size_t kMaxIncidents = 4096;

  explicit LinkFaultLedger(int64_t lease_ms) : window_ms_(kWindowLeases * lease_ms) {}

  struct Verdict {
    std::string take_out;  // the end that leaves the pipeline
    bool exclude = false;  // ... and gets no place until its record clears
    std::string why;
  };
  // `reporter` says its link with `accused` broke while running `epoch`.
  // nullopt when that link's break in that epoch was counted already.
  std::optional<Verdict> Report(const std::string& reporter, const std::string& accused,
                                uint64_t epoch, int64_t now_ms);

  // Why `worker_id` is excluded now; nullopt when it is not.
  std::optional<std::string> ExclusionOf(const std::string& worker_id, int64_t now_ms) const;

 private:
  struct Incident {
    std::string a, b;  // a < b
    uint64_t epoch = 0;
    int64_t at_ms = 0;
  };
  void Forget(int64_t now_ms);
  int CountFor(const std::string& worker_id, int64_t now_ms) const;

  const int64_t window_ms_;
  std::deque<Incident> incidents_;  // oldest first
  // Reporters excluded on a repeated break of one pair, and when.
  std::map<std::string, int64_t> excluded_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_LINK_FAULT_LEDGER_H_
