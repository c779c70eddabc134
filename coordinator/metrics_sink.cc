#include "coordinator/metrics_sink.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json.h"

namespace geotrain {

MetricsSink::MetricsSink(std::unique_ptr<AppendLog> log, size_t window_steps,
                         std::unique_ptr<TensorBoardWriter> curves)
    : log_(std::move(log)), window_steps_(window_steps), curves_(std::move(curves)) {}

void MetricsSink::RecordStep(double now_s, const StepFigures& figures) {
  recent_.emplace_back(now_s, figures.samples);
  while (recent_.size() > window_steps_ + 1) recent_.pop_front();
  // The first step has no window yet: its rate is the run's average so far.
  double samples_per_s = SamplesPerSecond();
  if (recent_.size() < 2 && figures.training_s > 0) {
    samples_per_s = figures.samples / figures.training_s;
  }
  history_.AddStep({figures.step, figures.loss, samples_per_s, figures.training_s});
  if (curves_ != nullptr) {
    Scalars scalars = {{"train/loss", figures.loss},
                       {"train/samples_per_second", samples_per_s},
                       {"train/learning_rate", figures.learning_rate}};
    for (const auto& [pipeline, loss] : figures.pipeline_losses) {
      scalars.emplace_back(absl::StrCat("pipeline/", pipeline, "/loss"), loss);
    }
    curves_->Write(figures.step, absl::Now(), scalars);
  }
  if (log_ == nullptr) return;
  std::string rss;
  for (const auto& [name, bytes] : figures.rss_bytes) {
    absl::StrAppend(&rss, rss.empty() ? "" : ",", "\"", JsonEscape(name), "\":", bytes);
  }
  std::string pipelines;
  for (const auto& [pipeline, loss] : figures.pipeline_losses) {
    absl::StrAppend(&pipelines, pipelines.empty() ? ",\"pipelines\":[" : ",",
                    absl::StrFormat("{\"pipeline\":%d,\"loss\":%.8g}", pipeline, loss));
  }
  if (!pipelines.empty()) pipelines += "]";
  log_->Append(absl::StrFormat(
      "{\"step\":%d,\"loss\":%.8g,\"samples\":%d,\"time_s\":%.3f,\"samples_per_s\":%.6g,"
      "\"lr\":%.8g,\"rss_bytes\":{%s}%s}",
      figures.step, figures.loss, figures.samples, figures.training_s, samples_per_s,
      figures.learning_rate, rss, pipelines));
}

void MetricsSink::RecordEval(double training_s, const v1::EvalReport& report) {
  history_.AddEval({report.step(), report.val_loss(), report.accuracy(), report.has_accuracy(),
                    training_s});
  if (curves_ != nullptr) {
    Scalars scalars = {{"eval/loss", report.val_loss()}};
    if (report.has_accuracy()) scalars.emplace_back("eval/accuracy", report.accuracy());
    curves_->Write(report.step(), absl::Now(), scalars);
  }
  if (log_ == nullptr) return;
  std::string line = absl::StrFormat("{\"eval\":true,\"step\":%d,\"val_loss\":%.8g,\"samples\":%d",
                                     report.step(), report.val_loss(), report.samples());
  if (report.has_accuracy()) {
    absl::StrAppend(&line, absl::StrFormat(",\"accuracy\":%.6f", report.accuracy()));
  }
  absl::StrAppend(&line, absl::StrFormat(",\"time_s\":%.3f}", training_s));
  log_->Append(std::move(line));
}

void MetricsSink::RecordStageCurves(int step, const Scalars& series) {
  if (curves_ != nullptr && !series.empty()) curves_->Write(step, absl::Now(), series);
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
  if (curves_ != nullptr) curves_->Flush();
}

}  // namespace geotrain
