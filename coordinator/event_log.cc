#include "coordinator/event_log.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json.h"
#include "common/logging.h"

namespace geotrain {
namespace {

std::string Bounded(std::string_view s, size_t max_bytes, bool mark) {
  if (s.size() <= max_bytes) return std::string(s);
  std::string out(s.substr(0, max_bytes));
  if (mark) out += "...";
  return out;
}

}  // namespace

EventLog::EventLog(EventLogOptions options) : options_(std::move(options)) {}

v1::Event EventLog::Add(std::string_view kind, std::string_view worker,
                        std::string_view detail) {
  v1::Event event;
  event.set_time_s((options_.clock->NowMs() - options_.start_ms) / 1000.0);
  event.set_kind(Bounded(kind, options_.max_kind_bytes, false));
  event.set_worker(Bounded(worker, options_.max_worker_bytes, false));
  event.set_detail(Bounded(detail, options_.max_detail_bytes, true));
  GT_LOG(Info) << "event " << event.kind() << (event.worker().empty() ? "" : " " + event.worker())
               << ": " << event.detail();
  if (options_.file != nullptr) {
    options_.file->Append(absl::StrFormat(
        "{\"time_s\":%.3f,\"kind\":\"%s\",\"worker\":\"%s\",\"detail\":\"%s\"}", event.time_s(),
        JsonEscape(event.kind()), JsonEscape(event.worker()), JsonEscape(event.detail())));
  }
  absl::MutexLock lock(&mu_);
  recent_.push_back(event);
  while (recent_.size() > options_.keep) recent_.pop_front();
  if (counts_.count(event.kind()) > 0 || counts_.size() < options_.max_counted_kinds) {
    ++counts_[event.kind()];
  } else {
    ++counts_["other"];
  }
  return event;
}

std::map<std::string, int64_t> EventLog::Counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

std::vector<v1::Event> EventLog::Recent() const {
  absl::MutexLock lock(&mu_);
  return {recent_.begin(), recent_.end()};
}

void EventLog::Flush() {
  if (options_.file != nullptr) options_.file->Flush();
}

}  // namespace geotrain
