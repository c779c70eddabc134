// The coordinator's /metrics: the job (step, losses, throughput, plan
// epoch, checkpoint age), its workers by state, re-plans and failures by
// reason, and per stage its workers, oldest heartbeat, slowest compute and
// largest bubble, all from one status snapshot. Bounded: the series grow
// with the plan's stages, never with the members (a thousand workers would
// make tens of thousands); each worker's own series are on its endpoint.
#ifndef GEOTRAIN_COORDINATOR_CLUSTER_METRICS_H_
#define GEOTRAIN_COORDINATOR_CLUSTER_METRICS_H_

#include "common/metrics_exporter.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

MetricsSnapshot ClusterMetrics(const v1::ClusterStatus& status);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_CLUSTER_METRICS_H_
