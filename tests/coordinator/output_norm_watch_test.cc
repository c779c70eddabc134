#include "coordinator/output_norm_watch.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>

#include "tests/coordinator/pipelines_plan.h"

namespace geotrain {
namespace {

constexpr uint64_t kEpoch = 4;  // PipelinesPlan's

// What a middle stage reports: the RMS of the activations it received from
// upstream and of the gradients it received from downstream, at sampled
// step `step`.
v1::StageStats Received(double activation_rms, double gradient_rms, int step) {
  v1::StageStats stats;
  for (auto [direction, rms] : {std::pair{"upstream", activation_rms},
                                std::pair{"downstream", gradient_rms}}) {
    v1::LinkStats* link = stats.add_links();
    link->set_direction(direction);
    link->set_received_rms(rms);
    link->set_received_measured(20);
    v1::StepRms* sample = link->add_received_rms_by_step();
    sample->set_step(step);
    sample->set_rms(rms);
    sample->set_messages(4);
  }
  return stats;
}

// The receivers' figures go to the senders: stage 1's report names stage
// 0's activations and stage 2's gradients.
TEST(OutputNormWatchTest, FiguresGoToTheSenders) {
  const v1::Plan plan = PipelinesPlan(1);
  OutputNormWatch watch;
  EXPECT_TRUE(watch.Record(plan, PipelineWorker(0, 1), kEpoch, Received(1.5, 0.02, 8)).empty());
  auto stage0 = watch.NormsOf(PipelineWorker(0, 0));
  ASSERT_EQ(stage0.size(), 1u);
  EXPECT_EQ(stage0[0].kind, "activation");
  EXPECT_EQ(stage0[0].stage, 0);
  EXPECT_EQ(stage0[0].step, 8);  // alone on its stage: judged at once
  EXPECT_DOUBLE_EQ(stage0[0].rms, 1.5);
  auto stage2 = watch.NormsOf(PipelineWorker(0, 2));
  ASSERT_EQ(stage2.size(), 1u);
  EXPECT_EQ(stage2[0].kind, "gradient");
  EXPECT_DOUBLE_EQ(stage2[0].rms, 0.02);
  EXPECT_TRUE(watch.NormsOf(PipelineWorker(0, 1)).empty());
  // A receiver still running another plan, or a link with no sampled step
  // yet: nothing is attributed.
  OutputNormWatch fresh;
  fresh.Record(plan, PipelineWorker(0, 1), kEpoch - 1, Received(1.5, 0.02, 8));
  EXPECT_TRUE(fresh.NormsOf(PipelineWorker(0, 0)).empty());
  v1::StageStats unsampled = Received(1.5, 0.02, 8);
  for (v1::LinkStats& link : *unsampled.mutable_links()) link.clear_received_rms_by_step();
  fresh.Record(plan, PipelineWorker(0, 1), kEpoch, unsampled);
  EXPECT_TRUE(fresh.NormsOf(PipelineWorker(0, 0)).empty());
}

// Among three pipelines, the worker whose gradients are 10x its replicas'
// is the suspect, and only it; honest replicas that differ by 30% are not.
TEST(OutputNormWatchTest, AnOutlierAmongReplicasIsTheSuspect) {
  const v1::Plan plan = PipelinesPlan(3);
  OutputNormWatch watch;
  // Stage 1 receivers report their stage-2 neighbours' gradients: 0.02,
  // 0.026 (honest spread), 0.2 (x10), the outlier's first: until all three
  // have a figure, none is judged against the others (the first two are
  // no pair).
  const double gradients[3] = {0.02, 0.026, 0.2};
  std::vector<OutputNorms> raised;
  for (int step = 8; step <= 24; step += 8) {
    for (int r : {2, 0, 1}) {
      for (OutputNorms& n :
           watch.Record(plan, PipelineWorker(r, 1), kEpoch, Received(1.0, gradients[r], step))) {
        raised.push_back(n);
      }
    }
  }
  ASSERT_EQ(raised.size(), 1u);
  EXPECT_EQ(raised[0].worker_id, PipelineWorker(2, 2));
  EXPECT_EQ(raised[0].kind, "gradient");
  EXPECT_NE(raised[0].suspicion.find("the median of its replicas'"), std::string::npos)
      << raised[0].suspicion;
  EXPECT_FALSE(watch.SuspicionOf(PipelineWorker(2, 2)).empty());
  EXPECT_TRUE(watch.SuspicionOf(PipelineWorker(0, 2)).empty());
  EXPECT_TRUE(watch.SuspicionOf(PipelineWorker(1, 2)).empty());

  EXPECT_NE(raised[0].suspicion.find("p2s2 0.2 (by p2s1 over 4)"), std::string::npos)
      << raised[0].suspicion;  // the figures it was judged on
  EXPECT_EQ(raised[0].step, 8);

  // It behaves again: the suspicion is cleared once every replica has a
  // figure of that step, with one change to report.
  EXPECT_TRUE(watch.Record(plan, PipelineWorker(2, 1), kEpoch, Received(1.0, 0.022, 32)).empty());
  EXPECT_TRUE(watch.Record(plan, PipelineWorker(0, 1), kEpoch, Received(1.0, 0.02, 32)).empty());
  auto cleared = watch.Record(plan, PipelineWorker(1, 1), kEpoch, Received(1.0, 0.026, 32));
  ASSERT_EQ(cleared.size(), 1u);
  EXPECT_EQ(cleared[0].worker_id, PipelineWorker(2, 2));
  EXPECT_TRUE(cleared[0].suspicion.empty());
  EXPECT_TRUE(watch.SuspicionOf(PipelineWorker(2, 2)).empty());
}

// Early in a run activations grow fast: each step's figure is 1.3x the
// last sampled one's, the same in every pipeline. Pipeline 2's receiver
// reports steps well ahead of the others' (its heartbeat left later), so
// its newest figure is 4.8x theirs; compared at the same step, nobody is a
// suspect. (Heartbeat-time figures made an honest worker one in CI.)
TEST(OutputNormWatchTest, ReplicasAreComparedAtTheSameStep) {
  const v1::Plan plan = PipelinesPlan(3);
  OutputNormWatch watch;
  auto honest = [](int step) { return 0.5 * std::pow(1.3, step / 8); };
  auto report = [&](int r, int from, int to) {
    v1::StageStats stats = Received(1.0, 0.02, from);
    for (v1::LinkStats& link : *stats.mutable_links()) {
      link.clear_received_rms_by_step();
      if (link.direction() != "upstream") continue;
      for (int step = from; step <= to; step += 8) {
        v1::StepRms* sample = link.add_received_rms_by_step();
        sample->set_step(step);
        sample->set_rms(honest(step));
        sample->set_messages(4);
      }
    }
    return watch.Record(plan, PipelineWorker(r, 1), kEpoch, stats);
  };
  EXPECT_TRUE(report(0, 8, 16).empty());
  EXPECT_TRUE(report(1, 8, 16).empty());
  EXPECT_TRUE(report(2, 8, 64).empty());
  auto norms = watch.NormsOf(PipelineWorker(2, 0));
  ASSERT_EQ(norms.size(), 1u);
  EXPECT_EQ(norms[0].step, 16);
  EXPECT_DOUBLE_EQ(norms[0].rms, honest(16));
  EXPECT_DOUBLE_EQ(norms[0].replicas_rms, honest(16));
  EXPECT_TRUE(report(0, 24, 64).empty());
  EXPECT_TRUE(report(1, 24, 56).empty());
  EXPECT_EQ(watch.NormsOf(PipelineWorker(2, 0))[0].step, 56);  // the newest all have
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(watch.SuspicionOf(PipelineWorker(r, 0)).empty()) << r;
  // Each step is judged once: a report that repeats it changes nothing.
  EXPECT_TRUE(report(1, 24, 56).empty());
  // A x10 at a later step is still found.
  v1::StageStats lie = Received(honest(72) * 10, 0.02, 72);
  watch.Record(plan, PipelineWorker(0, 1), kEpoch, Received(honest(72), 0.02, 72));
  watch.Record(plan, PipelineWorker(1, 1), kEpoch, Received(honest(72), 0.02, 72));
  auto raised = watch.Record(plan, PipelineWorker(2, 1), kEpoch, lie);
  ASSERT_EQ(raised.size(), 1u);
  EXPECT_EQ(raised[0].worker_id, PipelineWorker(2, 0));
  EXPECT_EQ(raised[0].step, 72);
}

// With two pipelines a diverging pair makes both suspects: the norms do not
// say which one lies (an audit does).
TEST(OutputNormWatchTest, ADivergingPairMakesBothSuspects) {
  const v1::Plan plan = PipelinesPlan(2);
  OutputNormWatch watch;
  watch.Record(plan, PipelineWorker(0, 1), kEpoch, Received(1.0, 0.02, 8));
  watch.Record(plan, PipelineWorker(1, 1), kEpoch, Received(1.0, 0.2, 8));
  EXPECT_FALSE(watch.SuspicionOf(PipelineWorker(0, 2)).empty());
  EXPECT_FALSE(watch.SuspicionOf(PipelineWorker(1, 2)).empty());
  EXPECT_TRUE(watch.SuspicionOf(PipelineWorker(0, 0)).empty());
}

// One pipeline: a worker is held to its own history. Honest drift, even
// 20x over a run as the demo GPT's gradients go, is no suspicion; a sudden
// x10 is, and the history does not learn it.
TEST(OutputNormWatchTest, AJumpAgainstItsOwnHistoryIsSuspect) {
  const v1::Plan plan = PipelinesPlan(1);
  OutputNormWatch watch;
  double gradient = 0.04;
  int step = 0;
  auto report = [&](double activation) {
    step += 8;
    return watch.Record(plan, PipelineWorker(0, 1), kEpoch, Received(activation, gradient, step));
  };
  for (int i = 0; i < 30; ++i) {  // down 20x, by 10% a sampled step
    gradient *= 0.9;
    EXPECT_TRUE(report(1.0).empty()) << i;
  }
  for (int i = 0; i < 30; ++i) {  // and back up
    gradient /= 0.9;
    EXPECT_TRUE(report(1.0).empty()) << i;
  }
  for (int i = 0; i < 5; ++i) report(10.0);
  const std::string why = watch.SuspicionOf(PipelineWorker(0, 0));
  EXPECT_NE(why.find("jumped to 10x the largest of their last 10 figures"), std::string::npos)
      << why;
  EXPECT_TRUE(watch.SuspicionOf(PipelineWorker(0, 2)).empty());
  auto norms = watch.NormsOf(PipelineWorker(0, 0));
  ASSERT_EQ(norms.size(), 1u);
  EXPECT_NEAR(norms[0].history_rms, 1.0, 1e-9);
  // A fall is caught the same way.
  gradient /= 10;
  for (int i = 0; i < 5; ++i) report(1.0);
  EXPECT_NE(watch.SuspicionOf(PipelineWorker(0, 2)).find("fell to 0.152x the smallest"), std::string::npos)
      << watch.SuspicionOf(PipelineWorker(0, 2));
  // Forgotten when it leaves.
  watch.Forget(PipelineWorker(0, 0));
  EXPECT_TRUE(watch.NormsOf(PipelineWorker(0, 0)).empty());
  EXPECT_FALSE(watch.NormsOf(PipelineWorker(0, 2)).empty());
}

// A worker the plan moves to another stage starts a new history, and
// figures of an older plan are not its replicas'.
TEST(OutputNormWatchTest, APlanThatMovesAWorkerStartsItsHistoryAgain) {
  v1::Plan plan = PipelinesPlan(1);
  plan.set_epoch(1);
  OutputNormWatch watch;
  for (int i = 1; i <= 10; ++i) {
    watch.Record(plan, PipelineWorker(0, 1), 1, Received(1.0, 0.02, 8 * i));
  }
  // Epoch 2: p0s0 now serves stage 1 (another stage, other numbers; its
  // receiver is the worker after it).
  v1::Plan moved = plan;
  moved.set_epoch(2);
  moved.mutable_stages(0)->set_worker_id("x");
  moved.mutable_stages(1)->set_worker_id(PipelineWorker(0, 0));
  moved.mutable_links(0)->set_upstream_worker("x");
  moved.mutable_links(0)->set_downstream_worker(PipelineWorker(0, 0));
  moved.mutable_links(1)->set_upstream_worker(PipelineWorker(0, 0));
  EXPECT_TRUE(watch.Record(moved, PipelineWorker(0, 2), 2, Received(30.0, 0.02, 88)).empty());
  auto norms = watch.NormsOf(PipelineWorker(0, 0));
  ASSERT_EQ(norms.size(), 1u);
  EXPECT_EQ(norms[0].stage, 1);
  EXPECT_DOUBLE_EQ(norms[0].history_rms, 0);  // too little history: a new one
  EXPECT_TRUE(norms[0].suspicion.empty());
}

// A figure that is not a number, a negative one, or from a worker the plan
// does not link is ignored.
TEST(OutputNormWatchTest, NonsenseIsIgnored) {
  const v1::Plan plan = PipelinesPlan(1);
  OutputNormWatch watch;
  watch.Record(plan, PipelineWorker(0, 1), kEpoch, Received(std::nan(""), -1, 8));
  for (const char* id : {"p0s0", "p0s2"}) {
    for (const OutputNorms& n : watch.NormsOf(id)) EXPECT_EQ(n.step, -1) << id;
  }
  watch.Record(plan, PipelineWorker(0, 1), kEpoch, Received(1.0, 0.02, -8));
  for (const OutputNorms& n : watch.NormsOf("p0s0")) EXPECT_EQ(n.step, -1);
  watch.Record(plan, "stranger", kEpoch, Received(1.0, 0.02, 16));
  for (const OutputNorms& n : watch.NormsOf("p0s0")) EXPECT_EQ(n.step, -1);
}

}  // namespace
}  // namespace geotrain
