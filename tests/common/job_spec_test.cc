#include "common/job_spec.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

namespace geotrain {
namespace {

constexpr char kValidGpt[] = R"(
  name: "t"
  gpt { context: 16 d_model: 32 heads: 4 blocks: 2 }
  text { paths: "/tmp" }
  steps: 10
)";

TEST(JobSpecTest, ParsesAndFillsDefaults) {
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(kValidGpt, "job.textproto");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->schedule(), v1::SCHEDULE_SYNC);
  EXPECT_EQ(job->microbatches(), 4);
  EXPECT_EQ(job->lease_ms(), 5000);
  EXPECT_EQ(job->optimizer().kind(), v1::Optimizer::KIND_ADAMW);
  EXPECT_EQ(job->gpt().mlp_ratio(), 4);
  EXPECT_DOUBLE_EQ(job->text().validation_fraction(), 0.05);
}

TEST(JobSpecTest, OuterBlockDefaultsAndAnExplicitZeroMomentum) {
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(
      "mlp { hidden: 8 } fashion_mnist {} steps: 10 outer { streaming: true }", "job.textproto");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->outer().inner_steps(), 50);
  EXPECT_DOUBLE_EQ(job->outer().lr(), 0.7);
  EXPECT_DOUBLE_EQ(job->outer().momentum(), 0.9);
  EXPECT_EQ(job->outer().codec(), v1::CODEC_INT8);
  EXPECT_TRUE(job->outer().streaming());
  absl::StatusOr<v1::JobSpec> averaging = ParseJobSpec(
      "mlp { hidden: 8 } fashion_mnist {} steps: 10 outer { lr: 1 momentum: 0 inner_steps: 1 }",
      "job.textproto");
  ASSERT_TRUE(averaging.ok()) << averaging.status();
  EXPECT_DOUBLE_EQ(averaging->outer().momentum(), 0);
  EXPECT_FALSE(ParseJobSpec("mlp { hidden: 8 } fashion_mnist {} steps: 10", "j")->has_outer());
  // The pipelines' cap: 1 without outer; split, at most the microbatches.
  EXPECT_EQ(PipelineCap(*ParseJobSpec("mlp { hidden: 8 } fashion_mnist {} steps: 10", "j")), 1);
  EXPECT_EQ(PipelineCap(*job), 0);
  EXPECT_EQ(PipelineCap(*ParseJobSpec("mlp { hidden: 8 } fashion_mnist {} steps: 10 "
                                      "microbatches: 4 outer { split_batch: true }",
                                      "j")),
            4);
  EXPECT_EQ(PipelineCap(*ParseJobSpec("mlp { hidden: 8 } fashion_mnist {} steps: 10 "
                                      "microbatches: 4 outer { split_batch: true "
                                      "max_pipelines: 2 }",
                                      "j")),
            2);
}

struct BadJobCase {
  const char* name;
  const char* text;
  const char* expected_fragment;
};

class BadJobTest : public testing::TestWithParam<BadJobCase> {};

TEST_P(BadJobTest, RefusedWithFileAndReason) {
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(GetParam().text, "jobs/bad.textproto");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(job.status().message());
  EXPECT_NE(message.find("jobs/bad.textproto"), std::string::npos) << message;
  EXPECT_NE(message.find(GetParam().expected_fragment), std::string::npos) << message;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadJobTest,
    testing::Values(
        BadJobCase{"syntax", "name: \"x\" gpt { context: }", "1:"},
        BadJobCase{"unknown_field", "nmae: \"x\"", "nmae"},
        BadJobCase{"no_model", "text { } steps: 1", "no model"},
        BadJobCase{"no_data", "gpt { context: 8 d_model: 8 heads: 2 blocks: 1 } steps: 1",
                   "no data"},
        BadJobCase{"heads_do_not_divide",
                   "gpt { context: 8 d_model: 10 heads: 4 blocks: 1 } text {} steps: 1",
                   "multiple of heads"},
        BadJobCase{"gpt_on_images",
                   "gpt { context: 8 d_model: 8 heads: 2 blocks: 1 } fashion_mnist {} "
                   "steps: 1",
                   "text"},
        BadJobCase{"mlp_on_text", "mlp { hidden: 8 } text {} steps: 1", "fashion_mnist"},
        BadJobCase{"no_steps", "mlp { hidden: 8 } fashion_mnist {}", "steps"},
        BadJobCase{"negative_lr",
                   "mlp { hidden: 8 } fashion_mnist {} steps: 1 optimizer { lr: -1 }",
                   "lr"},
        BadJobCase{"zero_width", "mlp { hidden: 0 } fashion_mnist {} steps: 1", "hidden"},
        BadJobCase{"short_lease", "mlp { hidden: 8 } fashion_mnist {} steps: 1 lease_ms: 5",
                   "lease_ms"},
        BadJobCase{"adaptive_without_a_codec",
                   "mlp { hidden: 8 } fashion_mnist {} steps: 1 adaptive: true",
                   "strongest codec"},
        BadJobCase{"outer_momentum_one",
                   "mlp { hidden: 8 } fashion_mnist {} steps: 1 outer { momentum: 1 }",
                   "outer.momentum"},
        BadJobCase{"outer_negative_inner_steps",
                   "mlp { hidden: 8 } fashion_mnist {} steps: 1 outer { inner_steps: -5 }",
                   "outer.inner_steps"},
        BadJobCase{"outer_split_more_pipelines_than_microbatches",
                   "mlp { hidden: 8 } fashion_mnist {} steps: 1 microbatches: 4 "
                   "outer { split_batch: true max_pipelines: 5 }",
                   "at least one microbatch"},
        BadJobCase{"outer_split_with_update_every",
                   "mlp { hidden: 8 } fashion_mnist {} steps: 1 microbatches: 4 "
                   "schedule: SCHEDULE_ASYNC_STASH update_every: 2 outer { split_batch: true }",
                   "update_every"},
        BadJobCase{"outer_topk",
                   "mlp { hidden: 8 } fashion_mnist {} steps: 1 outer { codec: CODEC_TOPK }",
                   "CODEC_TOPK"},
        BadJobCase{"outer_with_replicas",
                   "mlp { hidden: 8 } fashion_mnist {} steps: 1 schedule: SCHEDULE_ASYNC_STASH "
                   "replicas: 2 outer {}",
                   "do not mix"}),
    [](const testing::TestParamInfo<BadJobCase>& info) { return info.param.name; });

// Spot checks: off without the block; `verification {}` audits 1%; an
// explicit share is kept, 0 included; one outside [0, 1] is refused.
TEST(JobSpecTest, VerificationDefaultsAndBounds) {
  const std::string base = "mlp { hidden: 8 } fashion_mnist {} steps: 10 ";
  absl::StatusOr<v1::JobSpec> off = ParseJobSpec(base, "job.textproto");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_DOUBLE_EQ(off->verification().fraction(), 0);
  absl::StatusOr<v1::JobSpec> on = ParseJobSpec(base + "verification {}", "job.textproto");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_DOUBLE_EQ(on->verification().fraction(), 0.01);
  absl::StatusOr<v1::JobSpec> zero =
      ParseJobSpec(base + "verification { fraction: 0 }", "job.textproto");
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_DOUBLE_EQ(zero->verification().fraction(), 0);
  absl::StatusOr<v1::JobSpec> some =
      ParseJobSpec(base + "verification { fraction: 0.05 }", "job.textproto");
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_DOUBLE_EQ(some->verification().fraction(), 0.05);
  for (const char* bad : {"1.5", "-0.1", "nan"}) {
    absl::StatusOr<v1::JobSpec> refused =
        ParseJobSpec(base + "verification { fraction: " + bad + " }", "job.textproto");
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find("verification.fraction"), std::string::npos)
        << refused.status();
  }
}

TEST(JobSpecTest, MissingFileIsNamed) {
  absl::StatusOr<v1::JobSpec> job = LoadJobSpec("/nonexistent/job.textproto");
  ASSERT_FALSE(job.ok());
  EXPECT_NE(job.status().message().find("/nonexistent/job.textproto"), std::string::npos);
}

TEST(JobSpecTest, ShippedJobsAreValid) {
  for (const char* path : {"deploy/jobs/gpt-tiny.textproto", "deploy/jobs/fmnist-mlp.textproto",
                           "deploy/jobs/gpt-replicas.textproto", "deploy/jobs/llama-tiny.textproto"}) {
    absl::StatusOr<v1::JobSpec> job = LoadJobSpec(std::string(GEOTRAIN_SOURCE_DIR) + "/" + path);
    EXPECT_TRUE(job.ok()) << path << ": " << job.status();
  }
}

TEST(JobSpecTest, TokenFilesNeedALanguageModelAndBothFiles) {
  auto job = ParseJobSpec(
      "llama { context: 8 d_model: 16 heads: 2 blocks: 1 vocab: 1000 } "
      "tokens { train: \"t.bin\" validation: \"v.bin\" } steps: 3", "job");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->tokens().dtype(), v1::TokenData::UINT16);  // the default
  for (const char* bad :
       {"llama { context: 8 d_model: 16 heads: 2 blocks: 1 } tokens { train: \"t.bin\" }",
        "mlp { hidden: 4 } tokens { train: \"t.bin\" validation: \"v.bin\" }"}) {
    auto refused = ParseJobSpec(std::string(bad) + " steps: 3", "bad.job");
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find("tokens"), std::string::npos) << refused.status();
  }
}

TEST(JobSpecTest, ScheduleNamesRoundTrip) {
  EXPECT_EQ(*ParseSchedule(ScheduleName(v1::SCHEDULE_SYNC)), v1::SCHEDULE_SYNC);
  EXPECT_FALSE(ParseSchedule("gpipe-ish").ok());
}

}  // namespace
}  // namespace geotrain
