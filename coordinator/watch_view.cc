#include "coordinator/watch_view.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace geotrain {
namespace {

// Control bytes (a worker's name or an event's detail come from strangers)
// would move a terminal's cursor: shown as '?'.
std::string Printable(const std::string& text) {
  std::string out = text;
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return out;
}

std::string Cut(const std::string& frame, int max_width) {
  if (max_width <= 0) return frame;
  std::string out;
  for (absl::string_view line : absl::StrSplit(frame, '\n')) {
    absl::StrAppend(&out, line.substr(0, static_cast<size_t>(max_width)), "\n");
  }
  out.pop_back();  // the split's last piece had no newline after it
  return out;
}

}  // namespace

std::string WorkerStateName(v1::WorkerState state) {
  std::string name = v1::WorkerState_Name(state);
  const std::string prefix = "WORKER_STATE_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

std::string RenderWatchFrame(const v1::ClusterStatus& s, const WatchViewOptions& options) {
  std::string out;
  if (!options.title.empty()) absl::StrAppend(&out, Printable(options.title), "\n");
  absl::StrAppend(&out, absl::StrFormat("job %s  %s  step %d/%d  loss %.4f", Printable(s.job()),
                                        s.state(), s.step(), s.steps(), s.loss()));
  if (s.val_loss() > 0) absl::StrAppend(&out, absl::StrFormat("  val %.4f", s.val_loss()));
  if (s.accuracy() > 0) absl::StrAppend(&out, absl::StrFormat("  acc %.4f", s.accuracy()));
  absl::StrAppend(&out, absl::StrFormat("  samples/s %.1f  epoch %d  elapsed %.0fs\n",
                                        s.samples_per_s(), s.epoch(), s.elapsed_s()));

  // Workers: stage order, then standbys, then the rest (dead, left, done).
  std::vector<const v1::WorkerStatus*> workers;
  for (const v1::WorkerStatus& w : s.workers()) workers.push_back(&w);
  auto rank = [](const v1::WorkerStatus* w) {
    return std::make_tuple(w->stage() < 0 ? 1 : 0, w->state() != v1::WORKER_STATE_STANDBY,
                           w->stage(), w->replica());
  };
  std::stable_sort(workers.begin(), workers.end(),
                   [&](auto* a, auto* b) { return rank(a) < rank(b); });
  absl::StrAppend(&out, absl::StrFormat("\n%-6s %-8s %-14s %-9s %10s %7s %6s %7s\n", "STAGE",
                                        "LAYERS", "WORKER", "STATE", "COMPUTE_ms", "BUBBLE",
                                        "STALE", "HB_AGE"));
  std::map<std::string, std::string> name_by_address;
  for (const v1::WorkerStatus* w : workers) {
    name_by_address[w->address()] = w->name();
    const bool staged = w->stage() >= 0;
    const std::string stage = !staged           ? "-"
                              : w->replica() > 0 ? absl::StrFormat("%d.%d", w->stage(), w->replica())
                                                 : absl::StrCat(w->stage());
    const std::string layers =
        staged ? absl::StrFormat("[%d,%d)", w->layer_begin(), w->layer_end()) : "-";
    const bool figures = staged && w->compute_s_per_microbatch() > 0;
    absl::StrAppend(
        &out,
        absl::StrFormat("%-6s %-8s %-14s %-9s %10s %7s %6s %6.1fs\n", stage, layers,
                        Printable(w->name()), WorkerStateName(w->state()),
                        figures ? absl::StrFormat("%.2f", w->compute_s_per_microbatch() * 1e3)
                                : "-",
                        figures ? absl::StrFormat("%.0f%%", w->bubble_fraction() * 100) : "-",
                        figures ? absl::StrFormat("%.1f", w->staleness_mean()) : "-",
                        w->heartbeat_age_s()));
  }

  bool header = false;
  for (const v1::WorkerStatus* w : workers) {
    for (const v1::LinkStats& l : w->links()) {
      if (!header) {
        absl::StrAppend(&out, absl::StrFormat("\n%-30s %-10s %-5s %10s %10s %6s\n", "LINK",
                                              "DIRECTION", "CODEC", "RATE_Mb/s", "GOODPUT", "RATIO"));
        header = true;
      }
      const auto peer = name_by_address.find(l.peer());
      const std::string to = peer == name_by_address.end() ? l.peer() : peer->second;
      absl::StrAppend(
          &out, absl::StrFormat("%-30s %-10s %-5s %10s %10.1f %6.2f\n",
                                Printable(absl::StrCat(w->name(), " -> ", to)),
                                Printable(l.direction()), Printable(l.codec()),
                                l.link_rate_bps() > 0
                                    ? absl::StrFormat("%.1f", l.link_rate_bps() / 1e6)
                                    : "-",
                                l.goodput_bps() / 1e6, l.compression_ratio()));
    }
  }

  const int shown = std::min(std::max(options.events, 0), s.events_size());
  if (shown > 0) absl::StrAppend(&out, "\nlast events:\n");
  for (int i = s.events_size() - 1; i >= s.events_size() - shown; --i) {
    const v1::Event& e = s.events(i);
    absl::StrAppend(&out, absl::StrFormat("  %7.1fs %-12s %-10s %s\n", e.time_s(),
                                          Printable(e.kind()), Printable(e.worker()),
                                          Printable(e.detail())));
  }
  for (const std::string& note : s.truncated()) {
    absl::StrAppend(&out, "note: ", Printable(note), "\n");
  }
  return Cut(out, options.max_width);
}

}  // namespace geotrain
