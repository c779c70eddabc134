#include "common/stage_metrics.h"

namespace geotrain {
namespace {

MetricLabels With(MetricLabels labels, const std::string& name, const std::string& value) {
  labels.emplace_back(name, value);
  return labels;
}

}  // namespace

void AppendStageMetrics(const v1::StageStats& s, const MetricLabels& labels,
                        MetricsSnapshot* out) {
  out->Gauge("geotrain_stage_compute_seconds_per_microbatch",
             "Busy time per microbatch (forward and backward, sends excluded).", labels,
             s.compute_s_per_microbatch());
  out->Gauge("geotrain_stage_bubble_ratio", "Idle time over wall time, recent.", labels,
             s.bubble_fraction());
  out->Gauge("geotrain_stage_staleness_max_updates",
             "Most updates between a microbatch's forward and its backward.", labels,
             static_cast<double>(s.staleness_max()));
  out->Gauge("geotrain_stage_staleness_mean_updates",
             "Mean updates between a microbatch's forward and its backward.", labels,
             s.staleness_mean());
  out->Gauge("geotrain_stage_weight_versions", "Weight versions alive (the stash).", labels,
             s.weight_versions());
  out->Gauge("geotrain_stage_weight_versions_peak", "Most weight versions alive at once.",
             labels, s.max_weight_versions());
  out->Gauge("geotrain_stage_weight_bytes", "Bytes of the weight versions alive.", labels,
             static_cast<double>(s.weight_bytes()));
  out->Counter("geotrain_stage_microbatches_total", "Backwards done.", labels,
               static_cast<double>(s.microbatches()));
  out->Gauge("geotrain_stage_microbatches_per_second", "Backwards per second, recent.", labels,
             s.microbatches_per_s());
  out->Counter("geotrain_stage_dropped_microbatches_total",
               "Microbatches in flight dropped by re-plans on this worker.", labels,
               static_cast<double>(s.dropped_microbatches()));
  out->Counter("geotrain_stage_weight_averages_total",
               "Replicas: peer weights mixed into this stage.", labels,
               static_cast<double>(s.weight_averages()));
  out->Gauge("geotrain_stage_threads", "LibTorch threads now.", labels, s.threads());
  out->Gauge("geotrain_stage_peak_resident_bytes", "Peak resident memory of the worker.", labels,
             static_cast<double>(s.peak_rss_bytes()));
  for (const v1::LinkStats& link : s.links()) {
    const MetricLabels l = With(With(labels, "peer", link.peer()), "direction", link.direction());
    out->Counter("geotrain_link_sent_bytes_total",
                 "Tensor bytes sent: on the wire (encoded) and raw (before encoding).",
                 With(l, "encoding", "wire"), static_cast<double>(link.bytes_sent()));
    out->Counter("geotrain_link_sent_bytes_total", "", With(l, "encoding", "raw"),
                 static_cast<double>(link.raw_bytes_sent()));
    out->Counter("geotrain_link_received_bytes_total",
                 "Tensor bytes received: on the wire and decoded.", With(l, "encoding", "wire"),
                 static_cast<double>(link.bytes_received()));
    out->Counter("geotrain_link_received_bytes_total", "", With(l, "encoding", "raw"),
                 static_cast<double>(link.raw_bytes_received()));
    out->Counter("geotrain_link_sent_messages_total", "Messages sent.", l,
                 static_cast<double>(link.messages_sent()));
    out->Counter("geotrain_link_send_wait_seconds_total",
                 "Time spent waiting in sends (back-pressure).", l, link.send_s());
    out->Gauge("geotrain_link_rate_bytes_per_second",
               "The link's rate as its receiver measures it (0: not yet measured).", l,
               link.link_rate_bps() / 8);
    out->Gauge("geotrain_link_goodput_bytes_per_second",
               "Raw (decoded) bytes sent per second of training.", l, link.goodput_bps() / 8);
    out->Gauge("geotrain_link_compression_ratio", "Raw bytes over wire bytes.", l,
               link.compression_ratio());
    out->Gauge("geotrain_link_codec_info", "The link's codec now (value 1).",
               With(l, "codec", link.codec()), 1);
  }
}

}  // namespace geotrain
