#include "coordinator/event_log.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace geotrain {
namespace {

TEST(EventLogTest, KeepsTheNewestAndTimesThemByTheClock) {
  FakeClock clock(5000);
  EventLogOptions options;
  options.clock = &clock;
  options.start_ms = 1000;
  options.keep = 3;
  EventLog log(std::move(options));
  for (int i = 0; i < 5; ++i) {
    log.Add("joined", "w" + std::to_string(i), "detail");
    clock.AdvanceMs(500);
  }
  const std::vector<v1::Event> recent = log.Recent();
  ASSERT_EQ(recent.size(), 3u);
  EXPECT_EQ(recent[0].worker(), "w2");
  EXPECT_EQ(recent[2].worker(), "w4");
  EXPECT_DOUBLE_EQ(recent[0].time_s(), 5.0);  // (5000 + 2 x 500 - 1000) ms
}

TEST(EventLogTest, CountsEveryKindAndBoundsHowManyKinds) {
  FakeClock clock(0);
  EventLogOptions options;
  options.clock = &clock;
  options.keep = 2;  // counts outlive the events kept
  options.max_counted_kinds = 3;
  EventLog log(std::move(options));
  for (int i = 0; i < 4; ++i) log.Add("replanned", "", "");
  log.Add("lost", "w1", "");
  log.Add("kind-from-a-stranger-1", "w2", "");
  log.Add("kind-from-a-stranger-2", "w2", "");
  log.Add("kind-from-a-stranger-3", "w2", "");
  log.Add("lost", "w2", "");  // already counted: still its own
  const std::map<std::string, int64_t> counts = log.Counts();
  EXPECT_EQ(counts.at("replanned"), 4);
  EXPECT_EQ(counts.at("lost"), 2);
  EXPECT_EQ(counts.at("kind-from-a-stranger-1"), 1);
  EXPECT_EQ(counts.at("other"), 2);
  EXPECT_EQ(counts.size(), 4u);
}

TEST(EventLogTest, BoundsFieldsAndWritesJsonLines) {
  FakeClock clock(0);
  const std::string path = testing::TempDir() + "/event_log_test.log";
  std::filesystem::remove(path);
  AppendLogOptions file;
  file.path = path;
  EventLogOptions options;
  options.clock = &clock;
  options.file = *AppendLog::Open(file);
  EventLog log(std::move(options));
  const v1::Event event =
      log.Add(std::string(100, 'k'), std::string(300, 'w'), "say \"hi\"\n" + std::string(600, 'd'));
  EXPECT_EQ(event.kind().size(), 64u);
  EXPECT_EQ(event.worker().size(), 128u);
  EXPECT_EQ(event.detail().size(), 512u + 3);
  EXPECT_EQ(event.detail().substr(512), "...");
  log.Flush();
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  EXPECT_EQ(s.str().rfind("{\"time_s\":0.000,\"kind\":\"kkkk", 0), 0u);
  EXPECT_NE(s.str().find("\"detail\":\"say \\\"hi\\\"\\u000add"), std::string::npos);
  EXPECT_EQ(s.str().back(), '\n');
}

}  // namespace
}  // namespace geotrain
