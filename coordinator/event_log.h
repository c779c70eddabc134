// The job's events (joins, losses, plans, re-plan decisions, refusals):
// the newest `keep` for status, and every one as a JSON line in the state
// dir's events.log, written off the caller's thread (AppendLog). Each is
// logged too. Fields are bounded (a worker's name or a refusal's detail
// may come from a stranger). Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_EVENT_LOG_H_
#define GEOTRAIN_COORDINATOR_EVENT_LOG_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/append_log.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct EventLogOptions {
  const Clock* clock = nullptr;  // not owned; required
  int64_t start_ms = 0;          // events' time_s counts from here
  std::unique_ptr<AppendLog> file;  // null: events are kept in memory only
  size_t keep = 200;
  size_t max_kind_bytes = 64;
  size_t max_worker_bytes = 128;
  size_t max_detail_bytes = 512;  // longer details are cut, with "..."
  // Distinct kinds counted by Counts(); kinds past these (a worker names
  // the kinds of its reports) count as "other", so that a stranger cannot
  // grow the metrics without bound.
  size_t max_counted_kinds = 48;
};

class EventLog {
 public:
  explicit EventLog(EventLogOptions options);

  // Records an event now and returns it as kept.
  v1::Event Add(std::string_view kind, std::string_view worker, std::string_view detail);
  // The newest events, oldest first.
  std::vector<v1::Event> Recent() const;
  // Events added since this log was made, by kind (see max_counted_kinds).
  std::map<std::string, int64_t> Counts() const;
  // Waits until the events added so far are in the file.
  void Flush();

 private:
  const EventLogOptions options_;
  mutable absl::Mutex mu_;
  std::deque<v1::Event> recent_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_EVENT_LOG_H_
