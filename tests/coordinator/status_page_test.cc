#include "coordinator/status_page.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "coordinator/access_store.h"

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

TEST(ProgressHistoryTest, ThinsOutEvenlyInsteadOfGrowing) {
  ProgressHistory history(/*max_points=*/100);
  for (int step = 1; step <= 10000; ++step) history.AddStep({step, 1.0, 1.0, 1.0 * step});
  const std::vector<StepPoint> points = history.steps();
  EXPECT_LE(points.size(), 100u);
  EXPECT_GE(points.size(), 50u);
  EXPECT_EQ(points.front().step, 1);
  EXPECT_EQ(points.back().step, 10000);  // the newest is always there
  // Evenly spread over the whole run: every gap but the last (to the
  // newest) is the same, not dense at the end and sparse at the start.
  const int gap = points[1].step - points[0].step;
  for (size_t i = 1; i + 1 < points.size(); ++i) {
    EXPECT_EQ(points[i].step - points[i - 1].step, gap) << i;
  }
  EXPECT_LE(points.back().step - points[points.size() - 2].step, gap);
  EXPECT_LE(gap, 2 * 10000 / 50);
}

TEST(ProgressHistoryTest, AShortRunKeepsEveryPoint) {
  ProgressHistory history(/*max_points=*/100);
  for (int step = 1; step <= 99; ++step) history.AddStep({step, 1.0, 1.0, 1.0});
  history.AddEval({50, 2.0, 0, false, 1.0});
  ASSERT_EQ(history.steps().size(), 99u);
  EXPECT_EQ(history.steps()[41].step, 42);
  ASSERT_EQ(history.evals().size(), 1u);
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

class StatusPageTokenTest : public testing::Test {
 protected:
  void SetUp() override {
    const std::string path = testing::TempDir() + "/status_page_access.textproto";
    std::remove(path.c_str());
    auto opened = AccessStore::Open(path, "sha256:00");
    ASSERT_TRUE(opened.ok()) << opened.status();
    access_ = *std::move(opened);
    options_.access = access_.get();  // no controller: a refusal never reaches it
    handlers_ = StatusPageHandlers(options_);
  }

  std::string Token(v1::TokenRole role) {
    v1::CreateTokenRequest request;
    request.set_role(role);
    request.set_ttl_s(3600);
    auto created = access_->CreateToken(request);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->token() : "";
  }

  int Get(const std::string& path, const std::vector<std::string>& headers) {
    return HttpServer::Answer("GET " + path + " HTTP/1.1", headers, handlers_).status;
  }

  std::unique_ptr<AccessStore> access_;
  StatusPageOptions options_;
  std::map<std::string, HttpServer::Handler> handlers_;
};

TEST_F(StatusPageTokenTest, EverythingButThePageNeedsAViewerToken) {
  EXPECT_EQ(Get("/", {}), 200);  // the page itself holds no data
  const std::string worker = Token(v1::TOKEN_ROLE_WORKER);  // unlimited uses
  for (const char* path : {"/status.json", "/metrics"}) {
    EXPECT_EQ(Get(path, {}), 401) << path;
    EXPECT_EQ(Get(path, {"Authorization: Basic dXNlcjpwYXNz"}), 401) << path;
    EXPECT_EQ(Get(path, {"Authorization: Bearer not-a-token"}), 403) << path;
    EXPECT_EQ(Get(path, {"Authorization: Bearer " + worker}), 403) << path;  // another role
  }
  const HttpResponse refused = HttpServer::Answer(
      "GET /status.json HTTP/1.1", {"Authorization: bearer " + worker}, handlers_);
  EXPECT_EQ(refused.status, 403);  // the scheme's case does not matter
  // One answer for every reason: nothing about the token leaks.
  EXPECT_EQ(refused.body,
            "viewer token refused (unknown, expired, revoked, or not a viewer token)\n");
}

}  // namespace
}  // namespace geotrain
