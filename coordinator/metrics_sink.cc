#include "coordinator/metrics_sink.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json.h"

namespace geotrain {

MetricsSink::MetricsSink(std::unique_ptr<AppendLog> log, size_t window_steps)
    : log_(std::move(log)), window_steps_(window_steps) {}

void MetricsSink::RecordStep(double now_s, const StepFigures& figures) {
  recent_.emplace_back(now_s, figures.samples);
  while (recent_.size() > window_steps_ + 1) recent_.pop_front();
  if (log_ == nullptr) return;
  std::string rss;
  for (const auto& [name, bytes] : figures.rss_bytes) {
    absl::StrAppend(&rss, rss.empty() ? "" : ",", "\"", JsonEscape(name), "\":", bytes);
  }
  log_->Append(absl::StrFormat(
      "{\"step\":%d,\"loss\":%.8g,\"samples\":%d,\"time_s\":%.3f,\"rss_bytes\":{%s}}",
      figures.step, figures.loss, figures.samples, figures.training_s, rss));
}

void MetricsSink::RecordEval(double training_s, const v1::EvalReport& report) {
  if (log_ == nullptr) return;
  std::string line = absl::StrFormat("{\"eval\":true,\"step\":%d,\"val_loss\":%.8g,\"samples\":%d",
                                     report.step(), report.val_loss(), report.samples());
  if (report.has_accuracy()) {
    absl::StrAppend(&line, absl::StrFormat(",\"accuracy\":%.6f", report.accuracy()));
  }
  absl::StrAppend(&line, absl::StrFormat(",\"time_s\":%.3f}", training_s));
  log_->Append(std::move(line));
}

double MetricsSink::SamplesPerSecond() const {
  if (recent_.size() < 2 || recent_.back().first <= recent_.front().first) return 0;
  return (recent_.back().second - recent_.front().second) /
         (recent_.back().first - recent_.front().first);
}

double MetricsSink::SecondsPerSample() const {
  if (recent_.size() < 2 || recent_.back().second <= recent_.front().second) return 0;
  return (recent_.back().first - recent_.front().first) /
         (recent_.back().second - recent_.front().second);
}

void MetricsSink::Flush() {
  if (log_ != nullptr) log_->Flush();
}

}  // namespace geotrain
