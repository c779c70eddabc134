// ProgressTracker on its own: a hand-made plan (PlanView), members on a
// FakeClock, events in memory, no metrics file.
#include "coordinator/progress_tracker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>

#include "common/clock.h"
#include "common/job_spec.h"

namespace geotrain {
namespace {

class ProgressTrackerTest : public testing::Test {
 protected:
  void SetUp() override {
    auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} "
                            "steps: 200 min_workers: 2",
                            "test");
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *job;
    EventLogOptions events;
    events.clock = &clock_;
    events_ = std::make_unique<EventLog>(std::move(events));
    first_ = membership_.Join("a", "a:1", {}).id;
    last_ = membership_.Join("b", "b:1", {}).id;
    ProgressTrackerOptions options;
    options.job = &job_;
    options.clock = &clock_;
    options.membership = &membership_;
    options.plan = &plan_;
    options.events = events_.get();
    options.lead_steps = 8;
    // Persisting reads the figures back: a call under the tracker's lock
    // would deadlock here.
    options.persist = [this] {
      ++persists_;
      v1::CoordinatorState state;
      tracker_->FillState(&state);
      persisted_step_ = state.step();
    };
    tracker_ = std::make_unique<ProgressTracker>(options);
    StartPlan(1);
    tracker_->StartTraining();
  }

  // Two stages: a, then b (which owns the loss). `formed_epoch` (0: this
  // plan's): the epoch the pipeline was formed in, for one that goes on.
  void StartPlan(uint64_t epoch, int start_step = 0, uint64_t formed_epoch = 0) {
    v1::Plan plan;
    plan.set_epoch(epoch);
    plan.set_start_step(start_step);
    if (formed_epoch != 0) {
      v1::PipelineInfo* info = plan.add_pipeline_info();
      info->set_pipeline(0);
      info->set_formed_epoch(formed_epoch);
    }
    v1::StageAssignment* stage0 = plan.add_stages();
    stage0->set_stage(0);
    stage0->set_worker_id(first_);
    v1::StageAssignment* stage1 = plan.add_stages();
    stage1->set_stage(1);
    stage1->set_worker_id(last_);
    plan_.Set(std::make_shared<const v1::Plan>(plan));
    tracker_->StartEpoch(plan);
  }

  absl::Status Claim(int step, uint64_t epoch = 1, double loss = 2.0) {
    v1::StepReport report;
    report.set_worker_id(last_);
    report.set_epoch(epoch);
    report.set_step(step);
    report.set_loss(loss);
    report.set_samples(8);
    return tracker_->ReportStep(report);
  }

  bool HasEvent(const std::string& kind) {
    for (const v1::Event& e : events_->Recent()) {
      if (e.kind() == kind) return true;
    }
    return false;
  }

  FakeClock clock_{1000};
  v1::JobSpec job_;
  std::unique_ptr<EventLog> events_;
  Membership membership_{&clock_, 5000};
  PlanView plan_;
  std::unique_ptr<ProgressTracker> tracker_;
  std::string first_, last_;
  std::atomic<int> persists_{0};
  std::atomic<int> persisted_step_{-1};
};

TEST_F(ProgressTrackerTest, AStepCountsOnceBothEndsSaidSoAndIsPersistedOffTheLock) {
  ASSERT_TRUE(Claim(1).ok());
  EXPECT_EQ(tracker_->committed_step(), 0) << "a claim alone waits";
  EXPECT_EQ(persists_.load(), 0);
  tracker_->FirstStageFinished(first_, 1, 1);
  EXPECT_EQ(tracker_->committed_step(), 1);
  EXPECT_EQ(persists_.load(), 1);
  EXPECT_EQ(persisted_step_.load(), 1);
  // Stage 0 ahead, then the claim: it commits at once.
  tracker_->FirstStageFinished(first_, 1, 3);
  ASSERT_TRUE(Claim(2).ok());
  EXPECT_EQ(tracker_->committed_step(), 2);
  const ProgressTracker::Figures figures = tracker_->Snapshot();
  EXPECT_EQ(figures.samples, 16);
  EXPECT_DOUBLE_EQ(figures.loss, 2.0);
  // Refused: an old step, another epoch, stage 0 as a claimant of the
  // loss, a loss that is not finite.
  EXPECT_EQ(Claim(2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Claim(3, /*epoch=*/7).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Claim(3, 1, std::nan("")).code(), absl::StatusCode::kInvalidArgument);
  v1::EvalReport eval;
  eval.set_worker_id(first_);
  eval.set_epoch(1);
  EXPECT_EQ(tracker_->ReportEval(eval).code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(ProgressTrackerTest, AJumpAheadIsSuspectedOnce) {
  EXPECT_EQ(Claim(150).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Claim(151).code(), absl::StatusCode::kFailedPrecondition);
  int suspected = 0;
  for (const v1::Event& e : events_->Recent()) suspected += e.kind() == "suspected";
  EXPECT_EQ(suspected, 1);
  EXPECT_EQ(tracker_->committed_step(), 0);
}

TEST_F(ProgressTrackerTest, NothingCommitsBetweenCloseEpochAndTheNextPlan) {
  ASSERT_TRUE(Claim(1).ok());
  tracker_->FirstStageFinished(first_, 1, 1);
  ASSERT_TRUE(Claim(2).ok());
  // A new plan is being made: it resumes after the step returned, whatever
  // arrives meanwhile.
  EXPECT_EQ(tracker_->CloseEpoch(), 1);
  tracker_->FirstStageFinished(first_, 1, 2);
  // UNAVAILABLE: the worker sends it again once the plan is out.
  EXPECT_EQ(Claim(3).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(tracker_->committed_step(), 1);
  StartPlan(2, 1);
  // The old epoch's reports are refused; the new one's count.
  EXPECT_EQ(Claim(2, 1).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Claim(2, 2).ok());
  tracker_->FirstStageFinished(first_, 2, 2);
  EXPECT_EQ(tracker_->committed_step(), 2);
  EXPECT_TRUE(tracker_->pace().progress_in_epoch);
}

// A pipeline that goes on through a re-plan still owes the step it
// reported while the plan was being made: refused as UNAVAILABLE, sent
// again under the new plan, it counts, and no step of the job is passed
// over (CI once saw step 141 missing from the metrics log this way).
TEST_F(ProgressTrackerTest, AStepRefusedWhileAPlanIsMadeCountsWhenSentAgain) {
  ASSERT_TRUE(Claim(1).ok());
  tracker_->FirstStageFinished(first_, 1, 1);
  EXPECT_EQ(tracker_->CloseEpoch(), 1);
  tracker_->FirstStageFinished(first_, 1, 2);
  EXPECT_EQ(Claim(2).code(), absl::StatusCode::kUnavailable);
  StartPlan(2, 1, /*formed_epoch=*/1);  // the pipeline goes on
  ASSERT_TRUE(Claim(2).ok());
  tracker_->FirstStageFinished(first_, 1, 3);
  ASSERT_TRUE(Claim(3).ok());
  EXPECT_EQ(tracker_->committed_step(), 3);
  v1::CoordinatorState state;
  tracker_->FillState(&state);
  EXPECT_EQ(state.samples(), 3 * 8) << "a step was passed over";
}

TEST_F(ProgressTrackerTest, DoneOnlyAfterTheLastStepAndOnceForTheWholePlan) {
  v1::DoneReport done;
  done.set_worker_id(first_);
  done.set_step(200);
  EXPECT_EQ(tracker_->ReportDone(done).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasEvent("suspected")) << "far from the end: a lie, not a race";
  for (int step = 1; step <= 200; ++step) {
    ASSERT_TRUE(Claim(step).ok()) << step;
    tracker_->FirstStageFinished(first_, 1, step);
  }
  absl::StatusOr<bool> first = tracker_->ReportDone(done);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(*first) << "stage 1 is not done yet";
  done.set_worker_id("w42");
  EXPECT_EQ(tracker_->ReportDone(done).status().code(), absl::StatusCode::kPermissionDenied);
  done.set_worker_id(last_);
  absl::StatusOr<bool> all = tracker_->ReportDone(done);
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE(*all);
  EXPECT_FALSE(*tracker_->ReportDone(done)) << "once";
  EXPECT_TRUE(tracker_->IsDone(first_));
  EXPECT_EQ(tracker_->DoneWorkers().size(), 2u);
}

TEST_F(ProgressTrackerTest, TheWatchdogsPaceFollowsCommits) {
  ProgressTracker::Pace pace = tracker_->pace();
  EXPECT_FALSE(pace.progress_in_epoch);
  EXPECT_EQ(pace.epoch_started_ms, 1000);
  for (int step = 1; step <= 5; ++step) {
    clock_.AdvanceMs(100);
    ASSERT_TRUE(Claim(step).ok());
    tracker_->FirstStageFinished(first_, 1, step);
  }
  pace = tracker_->pace();
  EXPECT_TRUE(pace.progress_in_epoch);
  EXPECT_EQ(pace.step_interval_ms, 100);
  EXPECT_EQ(pace.last_progress_ms, 1500);
  tracker_->MarkStallHandled(9000);
  EXPECT_EQ(tracker_->pace().last_progress_ms, 9000);
}

}  // namespace
}  // namespace geotrain
