#include "coordinator/watch_view.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace geotrain {
namespace {

v1::ClusterStatus Example() {
  v1::ClusterStatus s;
  s.set_job("demo");
  s.set_state("training");
  s.set_step(12);
  s.set_steps(300);
  s.set_loss(3.25);
  s.set_samples_per_s(140.5);
  for (int stage = -1; stage < 2; ++stage) {
    v1::WorkerStatus* w = s.add_workers();
    w->set_name(stage < 0 ? "spare" : "w" + std::to_string(stage));
    w->set_address("10.0.0." + std::to_string(stage + 2) + ":7000");
    w->set_stage(stage);
    w->set_state(stage < 0 ? v1::WORKER_STATE_STANDBY : v1::WORKER_STATE_TRAINING);
    if (stage >= 0) {
      w->set_layer_begin(stage * 2);
      w->set_layer_end(stage * 2 + 2);
      w->set_compute_s_per_microbatch(0.0125);
      w->set_bubble_fraction(0.25);
    }
  }
  v1::LinkStats* link = s.mutable_workers(1)->add_links();  // w0 -> w1
  link->set_peer("10.0.0.3:7000");
  link->set_direction("downstream");
  link->set_codec("int8");
  link->set_link_rate_bps(98.5e6);
  link->set_goodput_bps(40e6);
  link->set_compression_ratio(3.9);
  for (int i = 0; i < 7; ++i) {
    v1::Event* e = s.add_events();
    e->set_time_s(i);
    e->set_kind("kind" + std::to_string(i));
    e->set_detail(i == 6 ? "evil \x1b[2J detail" : "detail");
  }
  return s;
}

TEST(WatchViewTest, ShowsStagesInOrderLinksAndTheNewestEventsFirst) {
  WatchViewOptions options;
  options.events = 3;
  options.title = "geotrain watch 127.0.0.1:7070";
  const std::string frame = RenderWatchFrame(Example(), options);
  const std::vector<std::string> lines = absl::StrSplit(frame, '\n');
  EXPECT_EQ(lines[0], "geotrain watch 127.0.0.1:7070");
  EXPECT_TRUE(absl::StartsWith(lines[1], "job demo  training  step 12/300  loss 3.2500"));
  // Stages first, in order, then the standby.
  const size_t w0 = frame.find("\n0      [0,2)    w0 "), w1 = frame.find("\n1      [2,4)    w1 "),
               spare = frame.find("\n-      -        spare ");
  ASSERT_NE(w0, std::string::npos) << frame;
  ASSERT_NE(w1, std::string::npos) << frame;
  ASSERT_NE(spare, std::string::npos) << frame;
  EXPECT_LT(w0, w1);
  EXPECT_LT(w1, spare);
  EXPECT_TRUE(absl::StrContains(frame, "12.50")) << frame;  // compute ms
  EXPECT_TRUE(absl::StrContains(frame, "25%")) << frame;
  EXPECT_TRUE(absl::StrContains(frame, "w0 -> w1")) << frame;  // peer address -> name
  EXPECT_TRUE(absl::StrContains(frame, "int8")) << frame;
  EXPECT_TRUE(absl::StrContains(frame, "98.5")) << frame;
  // The 3 newest events, newest first; a stranger's escape code is defused.
  const size_t newest = frame.find("kind6"), older = frame.find("kind4");
  EXPECT_LT(newest, older);
  EXPECT_FALSE(absl::StrContains(frame, "kind3"));
  EXPECT_FALSE(absl::StrContains(frame, "\x1b"));
  EXPECT_TRUE(absl::StrContains(frame, "evil ?[2J detail"));
  EXPECT_TRUE(absl::EndsWith(frame, "\n"));
}

TEST(WatchViewTest, CutsLinesToTheTerminalsWidth) {
  WatchViewOptions options;
  options.max_width = 20;
  const std::string frame = RenderWatchFrame(Example(), options);
  for (absl::string_view line : absl::StrSplit(frame, '\n')) EXPECT_LE(line.size(), 20u);
  EXPECT_TRUE(absl::EndsWith(frame, "\n"));
}

TEST(WatchViewTest, AnEmptyClusterStillDraws) {
  const std::string frame = RenderWatchFrame(v1::ClusterStatus(), WatchViewOptions());
  EXPECT_TRUE(absl::StartsWith(frame, "job ")) << frame;
  EXPECT_TRUE(absl::StrContains(frame, "step 0/0")) << frame;
  EXPECT_TRUE(absl::StrContains(frame, "STAGE")) << frame;
}

}  // namespace
}  // namespace geotrain
