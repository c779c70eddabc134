#include "coordinator/metrics_sink.h"

#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace geotrain {
namespace {

TEST(MetricsSinkTest, ThroughputOverTheWindow) {
  MetricsSink sink(nullptr, /*window_steps=*/2);
  EXPECT_EQ(sink.SamplesPerSecond(), 0);
  EXPECT_EQ(sink.SecondsPerSample(), 0);
  StepFigures figures;
  double now = 10;
  for (int step = 1; step <= 5; ++step) {
    figures.step = step;
    figures.samples = step * 100;
    // Steps 1-3 take 1 s each, steps 4 and 5 take 4 s: only the last two
    // steps are in the window.
    now += step <= 3 ? 1 : 4;
    sink.RecordStep(now, figures);
  }
  EXPECT_DOUBLE_EQ(sink.SamplesPerSecond(), 200.0 / 8);
  EXPECT_DOUBLE_EQ(sink.SecondsPerSample(), 8.0 / 200);
}

TEST(MetricsSinkTest, WritesStepAndEvalLinesWithoutWaitingForTheDisk) {
  const std::string path = testing::TempDir() + "/metrics_sink_test.jsonl";
  std::filesystem::remove(path);
  absl::Notification disk_free;
  std::atomic<int> stuck{0};
  AppendLogOptions file;
  file.path = path;
  file.before_write = [&] {
    ++stuck;
    disk_free.WaitForNotification();
    return absl::OkStatus();
  };
  MetricsSink sink(*AppendLog::Open(file));
  StepFigures figures;
  figures.step = 1;
  figures.loss = 2.5;
  figures.samples = 64;
  figures.training_s = 1.25;
  figures.learning_rate = 3e-4;
  figures.rss_bytes = {{"w\"1", 1000}, {"w2", 2000}};
  sink.RecordStep(1, figures);
  while (stuck == 0) absl::SleepFor(absl::Milliseconds(1));
  const absl::Time start = absl::Now();
  v1::EvalReport eval;
  eval.set_step(1);
  eval.set_val_loss(2.25);
  eval.set_samples(500);
  eval.set_has_accuracy(true);
  eval.set_accuracy(0.5);
  sink.RecordEval(1.5, eval);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  disk_free.Notify();
  sink.Flush();
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  EXPECT_EQ(s.str(),
            // The first step's rate: its samples over its time (no window yet).
            "{\"step\":1,\"loss\":2.5,\"samples\":64,\"time_s\":1.250,\"samples_per_s\":51.2,"
            "\"lr\":0.0003,\"rss_bytes\":{\"w\\\"1\":1000,\"w2\":2000}}\n"
            "{\"eval\":true,\"step\":1,\"val_loss\":2.25,\"samples\":500,\"accuracy\":0.500000,"
            "\"time_s\":1.500}\n");
}

}  // namespace
}  // namespace geotrain
