#include "common/metrics_exporter.h"

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <map>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/http_server.h"
#include "common/logging.h"

namespace geotrain {
namespace {

std::vector<prometheus::MetricFamily> ToPrometheus(
    const std::vector<MetricFamilySnapshot>& families) {
  std::vector<prometheus::MetricFamily> out;
  out.reserve(families.size());
  for (const MetricFamilySnapshot& f : families) {
    prometheus::MetricFamily family;
    family.name = f.name;
    family.help = f.help;
    family.type = f.type == MetricFamilySnapshot::Type::kCounter ? prometheus::MetricType::Counter
                                                                 : prometheus::MetricType::Gauge;
    for (const auto& [labels, value] : f.samples) {
      prometheus::ClientMetric metric;
      for (const auto& [name, label_value] : labels) {
        prometheus::ClientMetric::Label label;
        label.name = name;
        label.value = label_value;
        metric.label.push_back(std::move(label));
      }
      if (f.type == MetricFamilySnapshot::Type::kCounter) {
        metric.counter.value = value;
      } else {
        metric.gauge.value = value;
      }
      family.metric.push_back(std::move(metric));
    }
    out.push_back(std::move(family));
  }
  return out;
}

}  // namespace

void MetricsSnapshot::Gauge(const std::string& name, const std::string& help,
                            const MetricLabels& labels, double value) {
  Add(MetricFamilySnapshot::Type::kGauge, name, help, labels, value);
}

void MetricsSnapshot::Counter(const std::string& name, const std::string& help,
                              const MetricLabels& labels, double value) {
  Add(MetricFamilySnapshot::Type::kCounter, name, help, labels, value);
}

void MetricsSnapshot::Add(MetricFamilySnapshot::Type type, const std::string& name,
                          const std::string& help, const MetricLabels& labels, double value) {
  for (MetricFamilySnapshot& f : families_) {
    if (f.name == name) {
      f.samples.emplace_back(labels, value);
      return;
    }
  }
  MetricFamilySnapshot& f = families_.emplace_back();
  f.name = name;
  f.help = help;
  f.type = type;
  f.samples.emplace_back(labels, value);
}

std::string ExpositionText(const std::vector<MetricFamilySnapshot>& families) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, ToPrometheus(families));
  return out.str();
}

struct MetricsExporter::Impl {
  std::unique_ptr<HttpServer> server;
};

MetricsExporter::MetricsExporter(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

MetricsExporter::~MetricsExporter() = default;

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(const std::string& listen,
                                                                        Source source) {
  HttpServerOptions options;
  options.listen = listen;
  std::map<std::string, HttpServer::Handler> pages;
  pages["/metrics"] = [source = std::move(source)](const HttpRequest&) {
    HttpResponse response;
    response.content_type = "text/plain; version=0.0.4; charset=utf-8";
    response.body = ExpositionText(source().Take());
    return response;
  };
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Start(std::move(options), std::move(pages));
  if (!server.ok()) {
    return absl::UnavailableError(absl::StrCat("metrics: ", server.status().message()));
  }
  auto impl = std::make_unique<Impl>();
  impl->server = *std::move(server);
  const int port = impl->server->port();
  GT_LOG(Info) << "metrics: http://" << listen.substr(0, listen.rfind(':')) << ":" << port
               << "/metrics";
  return std::unique_ptr<MetricsExporter>(new MetricsExporter(std::move(impl), port));
}

}  // namespace geotrain
