// The coordinator's state directory: the current plan (replaced atomically:
// write, fsync, rename), the state, and where the append-only event log
// lives (AppendLog writes it). Thread-compatible.
#ifndef GEOTRAIN_COORDINATOR_STATE_STORE_H_
#define GEOTRAIN_COORDINATOR_STATE_STORE_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/files.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class StateStore {
 public:
  // Creates `dir` if needed and checks that it is writable.
  static absl::StatusOr<StateStore> Open(const std::string& dir);

  absl::Status WritePlan(const v1::Plan& plan);
  absl::Status WriteState(const v1::CoordinatorState& state);
  // What a previous coordinator left: nullopt when there is none,
  // DATA_LOSS when a file exists but does not parse.
  absl::StatusOr<std::optional<v1::Plan>> ReadPlan() const;
  absl::StatusOr<std::optional<v1::CoordinatorState>> ReadState() const;
  std::string events_log_path() const { return dir_ + "/events.log"; }
  const std::string& dir() const { return dir_; }

 private:
  explicit StateStore(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_STATE_STORE_H_
