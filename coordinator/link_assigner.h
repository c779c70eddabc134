// Who dials whom on each link of a plan. Pure function of the plan, which
// workers are reachable, and the usable relays; thread-safe.
#ifndef GEOTRAIN_COORDINATOR_LINK_ASSIGNER_H_
#define GEOTRAIN_COORDINATOR_LINK_ASSIGNER_H_

#include <functional>
#include <string>
#include <vector>

#include "coordinator/membership.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct LinkAssignerInput {
  // Whether a worker accepts connections (true when it was never probed).
  std::function<bool(const std::string& worker_id)> reachable;
  // Live relays that are reachable and not suspended.
  std::vector<WorkerRecord> relays;
  // A worker's name for the links' reasons.
  std::function<std::string(const std::string& worker_id)> name_of;
};

// Fills plan->links (replacing any): per pair of neighbouring workers
// (replicas included), the upstream one dials when the downstream one is
// reachable, else the downstream one when the upstream one is, else both
// dial a relay (the least loaded so far; a fresh random rendezvous), else
// none can (LINK_DIALER_NONE) and the link's reason says what to do.
// With several pipelines, also the outer sync's links (PlannedLink.outer):
// each stage's worker in pipeline r > 0 (as the upstream end) to the
// stage's worker in pipeline 0, chosen the same way.
void AssignLinks(const LinkAssignerInput& input, v1::Plan* plan);

// The plan as `viewer` may see it: a link's rendezvous is a secret of its
// two ends and its relay, and each end's proof of that end and the relay,
// so every other's is cleared.
v1::Plan PlanViewFor(const v1::Plan& plan, const std::string& viewer);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_LINK_ASSIGNER_H_
