// ProgressTracker and CheckpointGate through the controller: what one worker may claim.
#include "controller_fixtures.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

TEST_F(HostileInputTest, StepReportsOutOfRangeAreRefusedAndRealOnesStillCount) {
  const std::string a = Join("a").worker_id();
  const std::string b = Join("b").worker_id();
  v1::StepReport report;
  report.set_worker_id(b);
  report.set_epoch(1);
  report.set_samples(64);
  report.set_step(1000000000);
  report.set_loss(std::nan(""));
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kInvalidArgument);
  report.set_step(1);
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kInvalidArgument)
      << "a NaN loss";
  report.set_loss(2.5);
  report.set_samples(1 << 30);
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kInvalidArgument);
  report.set_samples(64);
  report.set_worker_id(a);  // stage 0 vouches for the step; it does not own the loss
  EXPECT_TRUE(controller_->ReportStep(report).ok());
  EXPECT_EQ(controller_->Status().step(), 0);
  report.set_worker_id(b);
  ASSERT_TRUE(controller_->ReportStep(report).ok());
  EXPECT_EQ(controller_->Status().step(), 1);
  controller_->FlushState();  // the logs are written off the caller's thread
  EXPECT_EQ(ReadFile(dir_ + "/metrics.jsonl").find("nan"), std::string::npos);
  v1::EvalReport eval;
  eval.set_worker_id(b);
  eval.set_epoch(1);
  eval.set_step(1);
  eval.set_val_loss(std::numeric_limits<double>::infinity());
  EXPECT_EQ(controller_->ReportEval(eval).code(), absl::StatusCode::kInvalidArgument);
  v1::DoneReport done;
  done.set_worker_id(b);
  done.set_step(1 << 30);
  EXPECT_EQ(controller_->ReportDone(done).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ProgressClaimTest, AJumpToTheLastStepIsRefusedAndSuspected) {
  TrainSteps(first_, last_, 104);
  EXPECT_EQ(controller_->Status().step(), 104);
  const absl::Status jump = Claim(3000, 0.01);
  EXPECT_EQ(jump.code(), absl::StatusCode::kFailedPrecondition) << jump;
  EXPECT_TRUE(HasEvent("suspected"));
  EXPECT_EQ(controller_->Status().step(), 104);
  // A restarted coordinator resumes where the pipeline really is, and the
  // honest reports that follow count.
  controller_->FlushState();
  EXPECT_EQ(ReadFile(dir_ + "/progress.textproto").find("step: 3000"), std::string::npos);
  ASSERT_TRUE(Claim(105).ok());
  FinishedOnStageZero(first_, 105);
  EXPECT_EQ(controller_->Status().step(), 105);
}

TEST_F(ProgressClaimTest, NeitherEndAloneMovesProgress) {
  // The last stage alone: its claims wait for stage 0.
  for (int step = 1; step <= 10; ++step) ASSERT_TRUE(Claim(step).ok());
  EXPECT_EQ(controller_->Status().step(), 0);
  // Stage 0 alone: it vouches for steps nobody claimed; nothing past the
  // claims commits.
  FinishedOnStageZero(first_, 2999);
  EXPECT_EQ(controller_->Status().step(), 10);
  // A claim twice is refused.
  EXPECT_EQ(Claim(10).code(), absl::StatusCode::kFailedPrecondition);
  // Nor can any other worker speak for either end.
  const std::string c = Join("c").worker_id();  // a standby
  FinishedOnStageZero(c, 2999);
  v1::StepReport report;
  report.set_worker_id(c);
  report.set_epoch(1);
  report.set_step(11);
  report.set_samples(8);
  EXPECT_EQ(controller_->ReportStep(report).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(controller_->Status().step(), 10);
}

TEST_F(ProgressClaimTest, DoneBeforeTheLastStepEndsNothing) {
  TrainSteps(first_, last_, 1);
  v1::DoneReport done;
  done.set_step(3000);
  for (const std::string& id : {first_, last_}) {
    done.set_worker_id(id);
    EXPECT_EQ(controller_->ReportDone(done).code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_FALSE(controller_->done());
  EXPECT_TRUE(HasEvent("suspected"));
  controller_->FlushState();
  EXPECT_EQ(controller_->WaitForPlan(1, absl::ZeroDuration()), nullptr)
      << "no final plan was published";
}

TEST_F(ProgressClaimTest, AWorkerWhoseLeaseRanOutIsOut) {
  TrainSteps(first_, last_, 2);
  clock_.AdvanceMs(1500);  // no heartbeat from `last_`; Tick has not run yet
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_worker_id(last_);
  EXPECT_FALSE(controller_->Heartbeat(heartbeat)) << "a lapsed lease is not renewed";
  EXPECT_EQ(Claim(3).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(controller_->checkpoint_gate().Save(FittingCheckpoint(last_, 3, 2)).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(ProgressClaimTest, ARevokedWorkersCheckpointsAreQuarantined) {
  // `last_` uploads honest checkpoints, then (a worker turned bad) a
  // scaled one at the newest step; a standby `c` takes over after the revoke.
  const std::string c = Join("c").worker_id();
  TrainSteps(first_, last_, 20);
  const int layer = Plan().stages(1).layer_begin();
  ASSERT_TRUE(controller_->checkpoint_gate().Save(FittingCheckpoint(last_, layer, 10)).ok());
  v1::LayerCheckpoint poisoned = FittingCheckpoint(last_, layer, 20);
  const float scaled = -8.0f;
  for (size_t i = 0; i < poisoned.payload().size(); i += 4) {
    std::memcpy(poisoned.mutable_payload()->data() + i, &scaled, 4);
  }
  ASSERT_TRUE(controller_->checkpoint_gate().Save(poisoned).ok());
  EXPECT_EQ(controller_->checkpoint_gate().Load(last_, layer)->step(), 20);
  EXPECT_TRUE(controller_->RevokeWorker(last_));
  EXPECT_TRUE(HasEvent("checkpoints_quarantined"));
  const v1::Plan plan = Plan();
  ASSERT_EQ(plan.stages(1).worker_id(), c) << "the standby took the stage";
  absl::StatusOr<v1::LayerCheckpoint> restored = controller_->checkpoint_gate().Load(c, layer);
  EXPECT_EQ(restored.status().code(), absl::StatusCode::kNotFound)
      << "every checkpoint of the layer came from the revoked worker";
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/checkpoints/quarantine"));
}

TEST_F(ProgressClaimTest, ARestoreFallsBackToTheNewestTrustedCheckpoint) {
  const std::string c = Join("c").worker_id();  // a standby
  TrainSteps(first_, last_, 20);
  const int layer = Plan().stages(1).layer_begin();
  ASSERT_TRUE(controller_->checkpoint_gate().Save(FittingCheckpoint(last_, layer, 10)).ok());
  // The stage moves to `c`, which uploads every weight scaled by -8 (finite)
  // at the newest step it may.
  ASSERT_TRUE(ReportLinkLost(first_, last_, 1).ok());
  ASSERT_EQ(Plan().stages(1).worker_id(), c);
  v1::LayerCheckpoint poisoned = FittingCheckpoint(c, layer, 20);
  const float scaled = -8.0f;
  for (size_t i = 0; i < poisoned.payload().size(); i += 4) {
    std::memcpy(poisoned.mutable_payload()->data() + i, &scaled, 4);
  }
  ASSERT_TRUE(controller_->checkpoint_gate().Save(poisoned).ok());
  EXPECT_EQ(controller_->checkpoint_gate().Load(c, layer)->step(), 20);
  clock_.AdvanceMs(10);
  for (const std::string& id : {first_, last_}) Heartbeat(id, 0);
  EXPECT_TRUE(controller_->RevokeWorker(c));
  ASSERT_EQ(Plan().stages(1).worker_id(), last_);
  absl::StatusOr<v1::LayerCheckpoint> restored = controller_->checkpoint_gate().Load(last_, layer);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), 10);
  EXPECT_EQ(restored->payload(), std::string(restored->payload().size(), '\0'));
}

// Issue 35: a worker caught computing wrong, trusted up to step 12, takes
// the whole job back to the newest step every layer has a checkpoint at
// or before it (10): the later checkpoints are quarantined, the next plan
// says so and starts there, the committed step goes back, and training
// goes on from it (steps 11 and up commit again). Here the worker caught
// had already left the plan (its link was lost and a standby took its
// stage), so the rollback's plan has the same workers; the checkpoints are
// all others' (the caught worker's own are quarantined whatever their
// step: nothing audits what a worker uploads).
TEST_F(ProgressClaimTest, AWrongComputationRollsTheJobBackToItsTrustedCheckpoint) {
  const std::string c = Join("c").worker_id();  // a standby
  TrainSteps(first_, last_, 20);
  ASSERT_TRUE(ReportLinkLost(first_, last_, 1).ok());
  const v1::Plan before = Plan();
  ASSERT_EQ(before.stages(1).worker_id(), c);
  for (int step : {10, 20}) {
    for (const v1::StageAssignment& stage : before.stages()) {
      for (int layer = stage.layer_begin(); layer < stage.layer_end(); ++layer) {
        ASSERT_TRUE(controller_->checkpoint_gate()
                        .Save(FittingCheckpoint(stage.worker_id(), layer, step))
                        .ok());
      }
    }
  }
  clock_.AdvanceMs(10);
  for (const std::string& id : {first_, c}) Heartbeat(id, 0);
  controller_->RevokeWorker(last_, /*trusted_step=*/12);
  EXPECT_TRUE(HasEvent("checkpoints_rolled_back"));
  EXPECT_TRUE(HasEvent("rolled_back"));
  const v1::Plan plan = Plan();
  EXPECT_EQ(plan.epoch(), before.epoch() + 1);
  EXPECT_EQ(plan.stages(1).worker_id(), c);
  EXPECT_EQ(plan.rollback_epoch(), plan.epoch());
  EXPECT_EQ(plan.rollback_step(), 10);
  EXPECT_EQ(plan.start_step(), 10);
  // Its steps draw again what steps 11 and up drew the first time.
  EXPECT_EQ(plan.data_base(), uint64_t{10} * std::max(1, job_.microbatches()));
  EXPECT_EQ(controller_->Status().step(), 10);
  for (const v1::StageAssignment& stage : plan.stages()) {
    for (int layer = stage.layer_begin(); layer < stage.layer_end(); ++layer) {
      absl::StatusOr<v1::LayerCheckpoint> restored =
          controller_->checkpoint_gate().Load(stage.worker_id(), layer);
      ASSERT_TRUE(restored.ok()) << restored.status();
      EXPECT_EQ(restored->step(), 10) << layer;
    }
  }
  // Training goes on from step 10.
  for (int step = 11; step <= 12; ++step) {
    v1::StepReport report;
    report.set_worker_id(c);
    report.set_epoch(plan.epoch());
    report.set_step(step);
    report.set_loss(2.0);
    report.set_samples(8);
    ASSERT_TRUE(controller_->ReportStep(report).ok()) << step;
    FinishedOnStageZero(first_, step, plan.epoch());
  }
  EXPECT_EQ(controller_->Status().step(), 12);
  // A replica that restores late still takes the rollback's step, though
  // the primary has uploaded a newer one.
  ASSERT_TRUE(controller_->checkpoint_gate().Save(FittingCheckpoint(first_, 0, 12)).ok());
  EXPECT_EQ((*controller_->checkpoint_gate().Open(first_, 0))->header().step(), 12);
  EXPECT_EQ((*controller_->checkpoint_gate().Open(first_, 0, 10))->header().step(), 10);
  EXPECT_EQ(controller_->checkpoint_gate().Open(first_, 0, 11).status().code(),
            absl::StatusCode::kNotFound);
  // A later plan repeats the rollback; it does not roll back again.
  Join("d");
  controller_->RevokeWorker(c);
  ASSERT_EQ(Plan().epoch(), plan.epoch() + 1);
  EXPECT_EQ(Plan().rollback_epoch(), plan.epoch());
  EXPECT_EQ(Plan().rollback_step(), 10);
  EXPECT_EQ(controller_->Status().step(), 12);
}

}  // namespace
}  // namespace geotrain
