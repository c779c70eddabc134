// A stage's figures (v1::StageStats, as a worker measures them and sends
// them in its heartbeats) as Prometheus series: the worker's own /metrics
// and the coordinator's (which also covers workers no scraper can reach,
// behind NAT) name them alike.
#ifndef GEOTRAIN_COMMON_STAGE_METRICS_H_
#define GEOTRAIN_COMMON_STAGE_METRICS_H_

#include "common/metrics_exporter.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

// Appends the stage's series, labelled `labels` (worker, stage) and, per
// link, also peer and direction (downstream: activations; upstream:
// gradients).
void AppendStageMetrics(const v1::StageStats& stats, const MetricLabels& labels,
                        MetricsSnapshot* out);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_STAGE_METRICS_H_
