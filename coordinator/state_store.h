// The coordinator's state directory, the default CoordinatorStore: the
// current plan (plan.textproto) and the state's two parts
// (members.textproto, progress.textproto), each replaced atomically
// (write, fsync, rename), and where the append-only event log lives
// (AppendLog writes it). A state dir from before the split holds one
// state.textproto: it is read in place of a missing part, and removed once
// both parts are written. Thread-safe: the files are written
// independently, and the object holds only the path.
#ifndef GEOTRAIN_COORDINATOR_STATE_STORE_H_
#define GEOTRAIN_COORDINATOR_STATE_STORE_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/files.h"
#include "coordinator/coordinator_store.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class StateStore : public CoordinatorStore {
 public:
  // Creates `dir` if needed and checks that it is writable.
  static absl::StatusOr<StateStore> Open(const std::string& dir);

  absl::Status WritePlan(const v1::Plan& plan) override;
  absl::Status WriteMembers(const v1::CoordinatorState& members) override;
  absl::Status WriteProgress(const v1::CoordinatorState& progress) override;
  absl::StatusOr<std::optional<v1::Plan>> ReadPlan() const override;
  absl::StatusOr<std::optional<v1::CoordinatorState>> ReadState() const override;
  std::string Describe() const override { return "state dir " + dir_; }
  std::string events_log_path() const { return dir_ + "/events.log"; }
  const std::string& dir() const { return dir_; }

 private:
  explicit StateStore(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_STATE_STORE_H_
