#include "coordinator/status_page.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "absl/strings/match.h"

namespace geotrain {
namespace {

TEST(StatusJsonTest, HoldsTheStatusTheHistoryAndHealth) {
  v1::ClusterStatus status;
  status.set_job("demo \"quoted\"");
  status.set_step(2);
  v1::WorkerStatus* w = status.add_workers();
  w->set_name("w0");
  w->set_stage(0);
  ProgressHistory history;
  history.AddStep({1, 5.5, 0, 0.5});
  history.AddStep({2, 5.25, NAN, 1.0});  // no NaN reaches the JSON
  history.AddEval({2, 5.0, 0.25, true, 1.1});
  const std::string json = StatusJson(status, history, true);
  EXPECT_TRUE(absl::StartsWith(json, "{\"status\":{\"job\":\"demo \\\"quoted\\\"\""));
  EXPECT_TRUE(absl::StrContains(json, "\"name\":\"w0\""));
  EXPECT_TRUE(absl::StrContains(
      json, "\"steps\":[{\"step\":1,\"loss\":5.5,\"samples_per_s\":0,\"time_s\":0.5},"
            "{\"step\":2,\"loss\":5.25,\"samples_per_s\":0,\"time_s\":1}]"));
  EXPECT_TRUE(absl::StrContains(
      json, "\"evals\":[{\"step\":2,\"val_loss\":5,\"accuracy\":0.25,\"time_s\":1.1}]"));
  EXPECT_TRUE(absl::EndsWith(json, "\"health\":{\"coordinator\":\"SERVING\"}}"));
  EXPECT_FALSE(absl::StrContains(json, "nan"));
  EXPECT_TRUE(absl::StrContains(StatusJson(status, history, false), "NOT_SERVING"));
}

TEST(ProgressHistoryTest, ThinsOutInsteadOfGrowing) {
  ProgressHistory history(/*max_points=*/100);
  for (int step = 1; step <= 10000; ++step) history.AddStep({step, 1.0, 1.0, 1.0 * step});
  EXPECT_LE(history.steps().size(), 100u);
  EXPECT_GE(history.steps().size(), 50u);
  EXPECT_EQ(history.steps().front().step, 1);
  EXPECT_EQ(history.steps().back().step, 10000);  // the newest is kept
  for (size_t i = 1; i < history.steps().size(); ++i) {
    EXPECT_LT(history.steps()[i - 1].step, history.steps()[i].step);
  }
}

TEST(StatusPageTest, ThePageIsSelfContained) {
  const std::string page = kStatusPageHtml;
  EXPECT_TRUE(absl::StartsWith(page, "<!DOCTYPE html>"));
  EXPECT_TRUE(absl::StrContains(page, "status.json"));
  EXPECT_TRUE(absl::StrContains(page, "</html>"));
  for (const char* external : {"<script src", "<link ", "@import", "url(http", "//cdn"}) {
    EXPECT_FALSE(absl::StrContains(page, external)) << external;
  }
}

}  // namespace
}  // namespace geotrain
