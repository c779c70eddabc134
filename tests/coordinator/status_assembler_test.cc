// StatusAssembler on its own: members on a FakeClock, a hand-made plan,
// a tracker with no reports, the controller's facts from a lambda.
#include "coordinator/status_assembler.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/job_spec.h"

namespace geotrain {
namespace {

class StatusAssemblerTest : public testing::Test {
 protected:
  void SetUp() override {
    auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} "
                            "steps: 200 min_workers: 2",
                            "test");
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *job;
    const std::string dir = testing::TempDir() + "/status_assembler_" +
                            testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    auto store = CheckpointStore::Open(dir);
    ASSERT_TRUE(store.ok()) << store.status();
    checkpoints_ = *std::move(store);
    EventLogOptions events;
    events.clock = &clock_;
    events_ = std::make_unique<EventLog>(std::move(events));
    ProgressTrackerOptions progress;
    progress.job = &job_;
    progress.clock = &clock_;
    progress.membership = &membership_;
    progress.plan = &plan_;
    progress.events = events_.get();
    progress_ = std::make_unique<ProgressTracker>(progress);
    CheckpointGateOptions gate;
    gate.job = &job_;
    gate.store = checkpoints_.get();
    gate.plan = &plan_;
    gate.membership = &membership_;
    gate.progress = &progress_->gate();
    gate.events = events_.get();
    gate_ = std::make_unique<CheckpointGate>(gate);
    StatusSources sources;
    sources.job = &job_;
    sources.clock = &clock_;
    sources.membership = &membership_;
    sources.plan = &plan_;
    sources.progress = progress_.get();
    sources.network = &network_;
    sources.events = events_.get();
    sources.checkpoints = checkpoints_.get();
    sources.checkpoint_gate = gate_.get();
    sources.facts = [this](const std::vector<std::string>& ids) {
      ControllerFacts facts;
      asked_ = ids;
      facts.suspected["w3"] = "in 3 broken links";
      return facts;
    };
    assembler_ = std::make_unique<StatusAssembler>(sources);
  }

  // Members w0..w(n-1): the first two hold the two stages, w(n-1) left.
  void Members(int n) {
    for (int i = 0; i < n; ++i) membership_.Join(absl::StrCat("host-", i), "h:1", {});
    membership_.Leave(absl::StrCat("w", n - 1), "left");
    v1::Plan plan;
    plan.set_epoch(3);
    for (int stage = 0; stage < 2; ++stage) {
      v1::StageAssignment* s = plan.add_stages();
      s->set_stage(stage);
      s->set_worker_id(absl::StrCat("w", stage));
      s->set_layer_begin(2 * stage);
      s->set_layer_end(2 * stage + 2);
    }
    plan_.Set(std::make_shared<const v1::Plan>(plan));
  }

  v1::ClusterStatus Get(const v1::ClusterStatusRequest& request) {
    absl::StatusOr<v1::ClusterStatus> status = assembler_->Assemble(request);
    EXPECT_TRUE(status.ok()) << status.status();
    return status.ok() ? *status : v1::ClusterStatus();
  }

  FakeClock clock_{1000};
  v1::JobSpec job_;
  Membership membership_{&clock_, 5000};
  PlanView plan_;
  NetworkMatrix network_;
  std::unique_ptr<CheckpointStore> checkpoints_;
  std::unique_ptr<EventLog> events_;
  std::unique_ptr<ProgressTracker> progress_;
  std::unique_ptr<CheckpointGate> gate_;
  std::unique_ptr<StatusAssembler> assembler_;
  std::vector<std::string> asked_;
};

TEST_F(StatusAssemblerTest, PagesWalkEveryMemberOnceWithCountsOnEachPage) {
  Members(25);
  v1::ClusterStatusRequest request;
  request.set_page_size(10);
  std::vector<std::string> seen;
  for (int page = 0; page < 5; ++page) {
    const v1::ClusterStatus status = Get(request);
    EXPECT_EQ(status.workers_total(), 25);
    EXPECT_EQ(status.workers_matched(), 25);
    EXPECT_EQ(status.worker_states().at("training"), 2);
    EXPECT_EQ(status.worker_states().at("standby"), 22);
    EXPECT_EQ(status.worker_states().at("left"), 1);
    ASSERT_EQ(status.stage_summary_size(), 2);
    EXPECT_EQ(status.stage_summary(1).layer_begin(), 2);
    EXPECT_EQ(status.epoch(), 3u);
    for (const v1::WorkerStatus& w : status.workers()) seen.push_back(w.id());
    if (status.next_page_token().empty()) break;
    request.set_page_token(status.next_page_token());
  }
  ASSERT_EQ(seen.size(), 25u);
  for (int i = 0; i < 25; ++i) EXPECT_EQ(seen[i], absl::StrCat("w", i));
  // The controller was asked about the last page's members only.
  EXPECT_EQ(asked_.size(), 5u);
}

// The link matrix grows with the members: a page leaves it out unless asked.
TEST_F(StatusAssemblerTest, ThePagedStatusCarriesTheLinkMatrixOnlyWhenAsked) {
  Members(4);
  network_.Learn("w1", "peer:1");
  network_.RecordLinkRate("w0", "peer:1", 1e9, 1000);
  EXPECT_EQ(Get(v1::ClusterStatusRequest()).network_size(), 1);  // the whole status
  v1::ClusterStatusRequest page;
  page.set_page_size(2);
  EXPECT_EQ(Get(page).network_size(), 0);
  page.set_include_network(true);
  EXPECT_EQ(Get(page).network_size(), 1);
}

TEST_F(StatusAssemblerTest, FiltersByStateStageAndName) {
  Members(12);
  v1::ClusterStatusRequest request;
  request.mutable_filter()->set_stage(1);
  v1::ClusterStatus status = Get(request);
  ASSERT_EQ(status.workers_size(), 1);
  EXPECT_EQ(status.workers(0).id(), "w1");
  EXPECT_EQ(status.workers(0).state(), v1::WORKER_STATE_TRAINING);
  EXPECT_EQ(status.workers_matched(), 1);
  EXPECT_EQ(status.workers_total(), 12);
  request.Clear();
  request.mutable_filter()->set_state("left");
  status = Get(request);
  ASSERT_EQ(status.workers_size(), 1);
  EXPECT_EQ(status.workers(0).id(), "w11");
  request.Clear();
  request.mutable_filter()->set_name_contains("host-1");  // host-1, host-10, host-11
  status = Get(request);
  EXPECT_EQ(status.workers_size(), 3);
  request.Clear();
  request.mutable_filter()->set_name_contains("w3");
  status = Get(request);
  ASSERT_EQ(status.workers_size(), 1);
  EXPECT_EQ(status.workers(0).suspected(), "in 3 broken links");
  request.Clear();
  request.mutable_filter()->set_pipeline(0);
  EXPECT_EQ(Get(request).workers_size(), 2) << "standbys are in no pipeline";
}

TEST_F(StatusAssemblerTest, BadRequestsAreRefused) {
  Members(3);
  v1::ClusterStatusRequest request;
  request.set_page_token("not a number");
  EXPECT_EQ(assembler_->Assemble(request).status().code(), absl::StatusCode::kInvalidArgument);
  request.set_page_token("-4");
  EXPECT_EQ(assembler_->Assemble(request).status().code(), absl::StatusCode::kInvalidArgument);
  request.set_page_token(std::string(4096, '9'));
  EXPECT_EQ(assembler_->Assemble(request).status().code(), absl::StatusCode::kInvalidArgument);
  request.Clear();
  request.set_page_size(-1);
  EXPECT_EQ(assembler_->Assemble(request).status().code(), absl::StatusCode::kInvalidArgument);
  request.Clear();
  request.mutable_filter()->set_state("sleeping");
  EXPECT_EQ(assembler_->Assemble(request).status().code(), absl::StatusCode::kInvalidArgument);
  // A token past the end is an empty last page, not an error.
  request.Clear();
  request.set_page_token("100");
  const v1::ClusterStatus status = Get(request);
  EXPECT_EQ(status.workers_size(), 0);
  EXPECT_TRUE(status.next_page_token().empty());
}

}  // namespace
}  // namespace geotrain
