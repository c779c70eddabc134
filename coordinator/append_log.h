// An append-only file written on a thread of its own: the events log and
// the metrics JSONL (lines), TensorBoard's event file (binary records). Callers (a step report under the controller's lock
// above all) hand a line over and return; the disk is never waited on. A
// disk slower than the lines that come is absorbed by a bounded queue; past
// `max_pending_lines` the oldest pending lines are dropped and counted, so
// memory stays bounded whatever the disk does. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_APPEND_LOG_H_
#define GEOTRAIN_COORDINATOR_APPEND_LOG_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace geotrain {

struct AppendLogOptions {
  std::string path;
  // A new job starts the file afresh; a recovering coordinator continues it.
  bool truncate = false;
  // Binary records, written as given (no newline). A record that a failed
  // write tore is cut off the file again (ftruncate), so a reader never
  // meets half a record before a whole one.
  bool binary_records = false;
  size_t max_pending_lines = 10000;
  // Past this size the file is rotated: renamed to `path`.1 (replacing the
  // previous one) and started afresh, so the log holds at most twice this
  // on disk whatever is appended. 0: never rotated. Lines only (not for
  // binary records, whose readers expect one file).
  uint64_t rotate_bytes = 0;
  // Runs on the writer's thread before each batch of lines (a fault-
  // injecting wrapper for tests: a slow or failing disk). A non-OK result
  // loses that batch (logged). Empty: none.
  std::function<absl::Status()> before_write;
};

class AppendLog {
 public:
  // UNAVAILABLE when the file cannot be opened for writing.
  static absl::StatusOr<std::unique_ptr<AppendLog>> Open(AppendLogOptions options);
  // Writes what is pending, then closes the file.
  ~AppendLog();
  AppendLog(const AppendLog&) = delete;
  AppendLog& operator=(const AppendLog&) = delete;

  // Queues `line` (a newline is added unless options.binary_records).
  // Never blocks on the disk.
  void Append(std::string line);
  // Waits until every line appended before the call is written (or lost).
  void Flush();
  int64_t written() const;  // lines
  int64_t dropped() const;  // lines lost to a full queue or a failed write
  const std::string& path() const { return options_.path; }

 private:
  AppendLog(AppendLogOptions options, int fd);
  void Run();
  // On the writer thread: `path` -> `path`.1, and a fresh `path`.
  void Rotate();

  const AppendLogOptions options_;
  int fd_;  // the writer thread's once it runs (it rotates the file)
  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // lines queued, a batch written, or stopping
  std::deque<std::string> pending_ ABSL_GUARDED_BY(mu_);
  int64_t appended_ ABSL_GUARDED_BY(mu_) = 0;  // sequence of the newest line
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;      // sequence of the newest written or lost
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_APPEND_LOG_H_
