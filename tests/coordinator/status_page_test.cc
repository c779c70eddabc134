#include "coordinator/status_page.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "controller_fixtures.h"
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

TEST(StatusRequestOfQueryTest, ReadsThePageAndTheFilter) {
  absl::StatusOr<v1::ClusterStatusRequest> request =
      StatusRequestOfQuery("page_size=50&page_token=100&name=gpu+box%2D1&state=standby&stage=2"
                           "&pipeline=1");
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->page_size(), 50);
  EXPECT_EQ(request->page_token(), "100");
  EXPECT_EQ(request->filter().name_contains(), "gpu box-1");
  EXPECT_EQ(request->filter().state(), "standby");
  EXPECT_EQ(request->filter().stage(), 2);
  EXPECT_EQ(request->filter().pipeline(), 1);
  EXPECT_FALSE(StatusRequestOfQuery("").value().has_filter());  // the whole status
  for (const char* bad : {"page_size=-1", "page_size=ten", "stage=", "color=red", "name=%zz",
                          "name=%4", "name=%"}) {
    absl::StatusOr<v1::ClusterStatusRequest> refused = StatusRequestOfQuery(bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(StatusRequestOfQuery(std::string(2000, 'a')).ok());
}

// The page asks a coordinator of many members for a page at a time, and
// for members by name or stage on demand.
class StatusJsonQueryTest : public JobControllerTest {};

TEST_F(StatusJsonQueryTest, ThePageAsksForAPageOrAFilter) {
  for (int i = 0; i < 30; ++i) Join(absl::StrCat("m-", i));
  StatusPageOptions options;
  options.controller = controller_.get();
  const auto handlers = StatusPageHandlers(options);
  auto get = [&](const std::string& target) {
    return HttpServer::Answer("GET " + target + " HTTP/1.1", {}, handlers);
  };
  auto count = [](const std::string& body, const std::string& what) {
    int n = 0;
    for (size_t at = body.find(what); at != std::string::npos; at = body.find(what, at + 1)) ++n;
    return n;
  };
  const HttpResponse page = get("/status.json?page_size=5");
  ASSERT_EQ(page.status, 200) << page.body;
  EXPECT_EQ(count(page.body, "\"address\":\"m-"), 5);
  EXPECT_TRUE(absl::StrContains(page.body, "\"workers_total\":30")) << page.body.substr(0, 400);
  EXPECT_TRUE(absl::StrContains(page.body, "\"next_page_token\":\"5\""));
  EXPECT_TRUE(absl::StrContains(page.body, "\"stage_summary\""));
  // m-1 and m-10 .. m-19.
  const HttpResponse named = get("/status.json?page_size=50&name=m-1");
  ASSERT_EQ(named.status, 200);
  EXPECT_EQ(count(named.body, "\"address\":\"m-"), 11);
  EXPECT_TRUE(absl::StrContains(named.body, "\"workers_matched\":11"));
  // Without a query: every member, as before.
  EXPECT_EQ(count(get("/status.json").body, "\"address\":\"m-"), 30);
  const HttpResponse refused = get("/status.json?page_size=many");
  EXPECT_EQ(refused.status, 400);
  EXPECT_TRUE(absl::StrContains(refused.body, "page_size")) << refused.body;
  EXPECT_EQ(get("/status.json?page_token=junk").status, 400);
}

}  // namespace
}  // namespace geotrain
