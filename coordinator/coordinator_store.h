// Where the coordinator keeps what must survive it: the published plan and
// the state, in two parts written apart:
//   - the members and the id counter, which change on joins and losses;
//   - the progress (step, samples, losses, the job's end), which changes on
//     every committed step.
// A step at 10,000 members rewrites a hundred bytes, not the 2 MB of
// members. Both parts travel as a v1::CoordinatorState holding only their
// fields, and ReadState joins them. The controller and its
// writers (PlanPublisher, DurableStateWriter) see only this interface:
//   - StateStore (state_store.h): files in the state dir, each replaced
//     atomically (write, fsync, rename, directory fsync);
//   - InMemoryCoordinatorStore (below): for tests, which wrap it to stall
//     or fail writes.
//
// Implementations are thread-safe: the plan publisher and the state writer
// write from their own threads, never under a lock of the controller.
#ifndef GEOTRAIN_COORDINATOR_COORDINATOR_STORE_H_
#define GEOTRAIN_COORDINATOR_COORDINATOR_STORE_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class CoordinatorStore {
 public:
  virtual ~CoordinatorStore() = default;

  // Durable when OK: a coordinator started on the same store reads it back.
  virtual absl::Status WritePlan(const v1::Plan& plan) = 0;
  // `members` holds the members and next_worker_number only.
  virtual absl::Status WriteMembers(const v1::CoordinatorState& members) = 0;
  // `progress` holds every field but those two.
  virtual absl::Status WriteProgress(const v1::CoordinatorState& progress) = 0;
  // What a previous coordinator left: nullopt when there is none,
  // DATA_LOSS when something is there but does not parse. ReadState joins
  // the two parts (either may be missing after a crash between the first
  // two writes: its fields are then unset).
  virtual absl::StatusOr<std::optional<v1::Plan>> ReadPlan() const = 0;
  virtual absl::StatusOr<std::optional<v1::CoordinatorState>> ReadState() const = 0;
  // For events and errors: "state dir /var/lib/geotrain".
  virtual std::string Describe() const = 0;
};

// Holds the plan and state in memory, as a durable store would hold them
// for as long as the object lives. Thread-safe.
class InMemoryCoordinatorStore : public CoordinatorStore {
 public:
  absl::Status WritePlan(const v1::Plan& plan) override;
  absl::Status WriteMembers(const v1::CoordinatorState& members) override;
  absl::Status WriteProgress(const v1::CoordinatorState& progress) override;
  absl::StatusOr<std::optional<v1::Plan>> ReadPlan() const override;
  absl::StatusOr<std::optional<v1::CoordinatorState>> ReadState() const override;
  std::string Describe() const override { return "in-memory store"; }

  int plan_writes() const;

 private:
  mutable absl::Mutex mu_;
  std::optional<v1::Plan> plan_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::CoordinatorState> members_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::CoordinatorState> progress_ ABSL_GUARDED_BY(mu_);
  int plan_writes_ ABSL_GUARDED_BY(mu_) = 0;
};

// The state a store keeps, from its two parts (either may be absent):
// nullopt when both are.
std::optional<v1::CoordinatorState> JoinStateParts(
    const std::optional<v1::CoordinatorState>& members,
    const std::optional<v1::CoordinatorState>& progress);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_COORDINATOR_STORE_H_
