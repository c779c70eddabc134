// What `geotrain-ctl watch` draws each second: the job's line, one row per
// worker (stage, state, compute, bubble, staleness, heartbeat), one row per
// link end (codec, measured rate, goodput, compression) and the last
// events, as plain text with no escape codes (the caller clears a terminal
// between frames; a pipe gets the frames one after another).
#ifndef GEOTRAIN_COORDINATOR_WATCH_VIEW_H_
#define GEOTRAIN_COORDINATOR_WATCH_VIEW_H_

#include <string>

#include "geotrain/v1/status.pb.h"

namespace geotrain {

struct WatchViewOptions {
  int events = 5;      // the most recent ones shown
  int max_width = 0;   // lines cut to this many bytes (a terminal's width); 0: not cut
  std::string title;   // first line, e.g. "geotrain watch 127.0.0.1:7070 12:00:01"
};

// "training", "standby", ... (the enum's name without its prefix, lower case).
std::string WorkerStateName(v1::WorkerState state);

std::string RenderWatchFrame(const v1::ClusterStatus& status, const WatchViewOptions& options);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_WATCH_VIEW_H_
