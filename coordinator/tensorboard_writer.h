// TensorBoard curves: scalars appended to an event file in a directory
// (`--tensorboard_dir`), events.out.tfevents.<unix seconds>.<host>.<pid>.
// Each call writes one Event (a Summary with every scalar given) as a
// TFRecord (common/tf_record.h), on the file's own thread (AppendLog): the
// caller never waits on the disk. A coordinator that starts again writes a
// new file beside the old ones; TensorBoard reads a directory's files as
// one run. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_TENSORBOARD_WRITER_H_
#define GEOTRAIN_COORDINATOR_TENSORBOARD_WRITER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/append_log.h"

namespace geotrain {

using Scalars = std::vector<std::pair<std::string, double>>;  // tag, value

class TensorBoardWriter {
 public:
  // Creates `dir` if needed and starts a new event file in it (its first
  // record names the format version). UNAVAILABLE when it cannot.
  static absl::StatusOr<std::unique_ptr<TensorBoardWriter>> Open(const std::string& dir);

  // One point of each series in `scalars` at `step`. Non-finite values are
  // left out (TensorBoard cannot draw them).
  void Write(int64_t step, absl::Time wall_time, const Scalars& scalars);
  // Returns once everything written before is on disk (or lost).
  void Flush();
  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(std::string path, std::unique_ptr<AppendLog> file)
      : path_(std::move(path)), file_(std::move(file)) {}

  const std::string path_;
  const std::unique_ptr<AppendLog> file_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_TENSORBOARD_WRITER_H_
