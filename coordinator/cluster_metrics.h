// The coordinator's /metrics: the job (step, losses, throughput, plan
// epoch, checkpoint age), its workers by state, re-plans and failures by
// reason, and every worker's stage and link figures from its heartbeats,
// all from one status snapshot.
#ifndef GEOTRAIN_COORDINATOR_CLUSTER_METRICS_H_
#define GEOTRAIN_COORDINATOR_CLUSTER_METRICS_H_

#include "common/metrics_exporter.h"
#include "geotrain/v1/status.pb.h"

namespace geotrain {

MetricsSnapshot ClusterMetrics(const v1::ClusterStatus& status);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_CLUSTER_METRICS_H_
