#include "coordinator/cluster_metrics.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "absl/strings/match.h"

namespace geotrain {
namespace {

v1::ClusterStatus TrainingStatus() {
  v1::ClusterStatus s;
  s.set_job("demo");
  s.set_state("training");
  s.set_schedule("async-stash");
  s.set_step(42);
  s.set_steps(300);
  s.set_samples(2688);
  s.set_loss(2.5);
  s.set_val_loss(2.6);
  s.set_checkpoint_age_s(3.5);
  (*s.mutable_event_counts())["replanned"] = 2;
  (*s.mutable_event_counts())["lost"] = 1;
  v1::WorkerStatus* w = s.add_workers();
  w->set_name("w0");
  w->set_stage(0);
  w->set_state(v1::WORKER_STATE_TRAINING);
  w->set_bubble_fraction(0.25);
  w->set_compute_s_per_microbatch(0.012);
  v1::LinkStats* link = w->add_links();
  link->set_peer("10.0.0.2:7001");
  link->set_direction("downstream");
  link->set_codec("int8");
  link->set_bytes_sent(1000);
  link->set_raw_bytes_sent(3900);
  link->set_link_rate_bps(100e6);
  v1::OutputNormStatus* norms = w->add_output_norms();
  norms->set_kind("gradient");
  norms->set_rms(0.2);
  norms->set_replicas_rms(0.02);
  norms->set_suspicion("its gradients (stage 0) measure 10x its replicas'");
  v1::WorkerStatus* standby = s.add_workers();
  standby->set_name("w1");
  standby->set_stage(-1);
  standby->set_state(v1::WORKER_STATE_STANDBY);
  return s;
}

TEST(ClusterMetricsTest, NamesFollowPrometheusConventions) {
  const std::string text = ExpositionText(ClusterMetrics(TrainingStatus()).Take());
  for (const char* line : {
           "# TYPE geotrain_job_step gauge", "geotrain_job_step 42",
           "# TYPE geotrain_job_samples_total counter", "geotrain_job_samples_total 2688",
           "geotrain_job_validation_loss 2.6", "geotrain_checkpoint_age_seconds 3.5",
           "geotrain_replans_total 2", "geotrain_failures_total{reason=\"lease_expired\"} 1",
           "geotrain_failures_total{reason=\"link_lost\"} 0",
           "geotrain_workers{state=\"training\"} 1", "geotrain_workers{state=\"standby\"} 1",
           "geotrain_workers{state=\"dead\"} 0",
           "geotrain_stage_workers{stage=\"0\"} 1",
           "geotrain_stage_bubble_max_ratio{stage=\"0\"} 0.25",
           "geotrain_stage_compute_max_seconds_per_microbatch{stage=\"0\"} 0.012",
           "geotrain_stage_output_norm_suspects{stage=\"0\"} 1",
           "geotrain_job_info{training_job=\"demo\",schedule=\"async-stash\",state=\"training\"} 1",
       }) {
    EXPECT_TRUE(absl::StrContains(text, line)) << line << "\nin:\n" << text;
  }
  // No series per worker (they are on the workers' own endpoints); a
  // standby counts in no stage; a family appears once with its type.
  EXPECT_FALSE(absl::StrContains(text, "worker=")) << text;
  EXPECT_FALSE(absl::StrContains(text, "stage=\"-1\"")) << text;
  EXPECT_EQ(text.find("# TYPE geotrain_stage_workers gauge"),
            text.rfind("# TYPE geotrain_stage_workers gauge"));
  // Every counter ends in _total; no series is labelled "job" (the scrape's).
  size_t at = 0;
  while ((at = text.find("# TYPE ", at)) != std::string::npos) {
    const size_t end = text.find('\n', at);
    const std::string type_line = text.substr(at, end - at);
    if (absl::EndsWith(type_line, " counter")) {
      EXPECT_TRUE(absl::StrContains(type_line, "_total ")) << type_line;
    }
    at = end;
  }
  EXPECT_FALSE(absl::StrContains(text, "{job=")) << text;
}

// A thousand members make as many series as a handful: per stage, not per
// worker.
TEST(ClusterMetricsTest, TheSeriesDoNotGrowWithTheMembers) {
  auto series = [](int members) {
    v1::ClusterStatus s = TrainingStatus();
    for (int i = 0; i < members; ++i) {
      v1::WorkerStatus* w = s.add_workers();
      w->set_name("m" + std::to_string(i));
      w->set_stage(i % 3);
      w->set_state(i % 2 == 0 ? v1::WORKER_STATE_TRAINING : v1::WORKER_STATE_STANDBY);
      w->set_heartbeat_age_s(i);
    }
    const std::string text = ExpositionText(ClusterMetrics(s).Take());
    size_t lines = 0;
    for (char c : text) lines += c == '\n';
    return std::make_pair(lines, text);
  };
  const auto [few, few_text] = series(6);
  const auto [many, many_text] = series(1000);
  EXPECT_EQ(few, many);
  EXPECT_TRUE(absl::StrContains(many_text, "geotrain_stage_workers{stage=\"1\"} 166"))
      << many_text;
  EXPECT_TRUE(absl::StrContains(many_text, "geotrain_stage_heartbeat_age_max_seconds{stage=\"2\"} 998"))
      << many_text;
}

TEST(ClusterMetricsTest, WithoutCheckpointsOrEvaluationsThoseSeriesAreAbsent) {
  v1::ClusterStatus s;
  s.set_job("demo");
  s.set_state("waiting");
  s.set_checkpoint_age_s(-1);
  const std::string text = ExpositionText(ClusterMetrics(s).Take());
  EXPECT_FALSE(absl::StrContains(text, "geotrain_checkpoint_age_seconds"));
  EXPECT_FALSE(absl::StrContains(text, "geotrain_job_validation_loss"));
  EXPECT_TRUE(absl::StrContains(text, "geotrain_replans_total 0"));
}

}  // namespace
}  // namespace geotrain
