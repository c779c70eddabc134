// The per-stage and per-link curves of one step, from the current plan and
// the workers' latest heartbeats: for each stage, its primary's compute
// seconds per microbatch, bubble fraction and mean staleness; for each of
// the primary's links, goodput and compression ratio. A stage whose primary
// has sent no figures yet is left out (JobController writes a step's points
// once every stage has); a link's series are named by stage, direction and
// the peer's worker name, so they stay put while the plan does. Replicas' own figures are in the status and the
// metrics endpoint, not here.
#ifndef GEOTRAIN_COORDINATOR_STAGE_SERIES_H_
#define GEOTRAIN_COORDINATOR_STAGE_SERIES_H_

#include <vector>

#include "coordinator/membership.h"
#include "coordinator/tensorboard_writer.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

// Tags like "stage0/compute_seconds_per_microbatch" and
// "link/stage0.downstream.w2/goodput_bits_per_second".
Scalars StageSeries(const v1::Plan& plan, const std::vector<WorkerRecord>& workers);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_STAGE_SERIES_H_
