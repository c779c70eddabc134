// A Prometheus endpoint: serves GET /metrics on HOST:PORT (common/
// http_server.h), in the text exposition format (prometheus-cpp's
// TextSerializer), from a snapshot the daemon takes at each scrape. The daemon describes its figures in the plain
// structs below; prometheus-cpp stays inside metrics_exporter.cc.
//
// Naming (https://prometheus.io/docs/practices/naming/): a geotrain_
// prefix, base units in the name (_seconds, _bytes, _ratio), _total on
// counters, and labels for worker, stage, peer and direction.
#ifndef GEOTRAIN_COMMON_METRICS_EXPORTER_H_
#define GEOTRAIN_COMMON_METRICS_EXPORTER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace geotrain {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

struct MetricFamilySnapshot {
  enum class Type { kGauge, kCounter };
  std::string name;
  std::string help;
  Type type = Type::kGauge;
  std::vector<std::pair<MetricLabels, double>> samples;
};

// Collects families by name, in the order first seen.
class MetricsSnapshot {
 public:
  void Gauge(const std::string& name, const std::string& help, const MetricLabels& labels,
             double value);
  void Counter(const std::string& name, const std::string& help, const MetricLabels& labels,
               double value);
  const std::vector<MetricFamilySnapshot>& families() const { return families_; }
  std::vector<MetricFamilySnapshot> Take() { return std::move(families_); }

 private:
  void Add(MetricFamilySnapshot::Type type, const std::string& name, const std::string& help,
           const MetricLabels& labels, double value);
  std::vector<MetricFamilySnapshot> families_;
};

// The text exposition format of `families` (what /metrics serves; tests).
std::string ExpositionText(const std::vector<MetricFamilySnapshot>& families);

class MetricsExporter {
 public:
  using Source = std::function<MetricsSnapshot()>;

  // Serves `source`'s snapshot on `listen` (HOST:PORT, port 0: any).
  // UNAVAILABLE when it cannot listen there. `source` runs on the HTTP
  // server's threads: it must be thread-safe.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(const std::string& listen,
                                                                Source source);
  ~MetricsExporter();

  int port() const { return port_; }

 private:
  struct Impl;
  explicit MetricsExporter(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_METRICS_EXPORTER_H_
