#include "coordinator/output_norm_watch.h"

#include <gtest/gtest.h>

#include <string>

#include "tests/coordinator/pipelines_plan.h"

namespace geotrain {
namespace {



// What a middle stage reports: the RMS of the activations it received from
// upstream and of the gradients it received from downstream.
v1::StageStats Received(double activation_rms, double gradient_rms, uint64_t measured = 20) {
  v1::StageStats stats;
  v1::LinkStats* up = stats.add_links();
  up->set_direction("upstream");
  up->set_received_rms(activation_rms);
  up->set_received_measured(measured);
  v1::LinkStats* down = stats.add_links();
  down->set_direction("downstream");
  down->set_received_rms(gradient_rms);
  down->set_received_measured(measured);
  return stats;
}

// The receivers' figures go to the senders: stage 1's report names stage
// 0's activations and stage 2's gradients.
TEST(OutputNormWatchTest, FiguresGoToTheSenders) {
  const v1::Plan plan = PipelinesPlan(1);
  OutputNormWatch watch;
  EXPECT_TRUE(watch.Record(plan, PipelineWorker(0, 1), Received(1.5, 0.02)).empty());
  auto stage0 = watch.NormsOf(PipelineWorker(0, 0));
  ASSERT_EQ(stage0.size(), 1u);
  EXPECT_EQ(stage0[0].kind, "activation");
  EXPECT_EQ(stage0[0].stage, 0);
  EXPECT_DOUBLE_EQ(stage0[0].rms, 1.5);
  auto stage2 = watch.NormsOf(PipelineWorker(0, 2));
  ASSERT_EQ(stage2.size(), 1u);
  EXPECT_EQ(stage2[0].kind, "gradient");
  EXPECT_DOUBLE_EQ(stage2[0].rms, 0.02);
  EXPECT_TRUE(watch.NormsOf(PipelineWorker(0, 1)).empty());
  // Too few messages measured: the figure does not count yet.
  OutputNormWatch fresh;
  fresh.Record(plan, PipelineWorker(0, 1), Received(1.5, 0.02, /*measured=*/3));
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
  for (int round = 0; round < 3; ++round) {
    for (int r : {2, 0, 1}) {
      for (OutputNorms& n : watch.Record(plan, PipelineWorker(r, 1), Received(1.0, gradients[r]))) {
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

  // It behaves again: the suspicion is cleared, with one change to report.
  auto cleared = watch.Record(plan, PipelineWorker(2, 1), Received(1.0, 0.022));
  ASSERT_EQ(cleared.size(), 1u);
  EXPECT_TRUE(cleared[0].suspicion.empty());
  EXPECT_TRUE(watch.SuspicionOf(PipelineWorker(2, 2)).empty());
}

// With two pipelines a diverging pair makes both suspects: the norms do not
// say which one lies (an audit does).
TEST(OutputNormWatchTest, ADivergingPairMakesBothSuspects) {
  const v1::Plan plan = PipelinesPlan(2);
  OutputNormWatch watch;
  watch.Record(plan, PipelineWorker(0, 1), Received(1.0, 0.02));
  watch.Record(plan, PipelineWorker(1, 1), Received(1.0, 0.2));
  watch.Record(plan, PipelineWorker(0, 1), Received(1.0, 0.02));
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
  for (int i = 0; i < 30; ++i) {  // down 20x, by 10% a heartbeat
    gradient *= 0.9;
    EXPECT_TRUE(watch.Record(plan, PipelineWorker(0, 1), Received(1.0, gradient)).empty()) << i;
  }
  for (int i = 0; i < 30; ++i) {  // and back up
    gradient /= 0.9;
    EXPECT_TRUE(watch.Record(plan, PipelineWorker(0, 1), Received(1.0, gradient)).empty()) << i;
  }
  for (int i = 0; i < 5; ++i) watch.Record(plan, PipelineWorker(0, 1), Received(10.0, gradient));
  const std::string why = watch.SuspicionOf(PipelineWorker(0, 0));
  EXPECT_NE(why.find("jumped to 10x the largest of their last 10 figures"), std::string::npos)
      << why;
  EXPECT_TRUE(watch.SuspicionOf(PipelineWorker(0, 2)).empty());
  auto norms = watch.NormsOf(PipelineWorker(0, 0));
  ASSERT_EQ(norms.size(), 1u);
  EXPECT_NEAR(norms[0].history_rms, 1.0, 1e-9);
  // A fall is caught the same way.
  for (int i = 0; i < 5; ++i) watch.Record(plan, PipelineWorker(0, 1), Received(1.0, gradient / 10));
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
  for (int i = 0; i < 10; ++i) watch.Record(plan, PipelineWorker(0, 1), Received(1.0, 0.02));
  // Epoch 2: p0s0 now serves stage 1 (another stage, other numbers; its
  // receiver is the worker after it).
  v1::Plan moved = plan;
  moved.set_epoch(2);
  moved.mutable_stages(0)->set_worker_id("x");
  moved.mutable_stages(1)->set_worker_id(PipelineWorker(0, 0));
  moved.mutable_links(0)->set_upstream_worker("x");
  moved.mutable_links(0)->set_downstream_worker(PipelineWorker(0, 0));
  moved.mutable_links(1)->set_upstream_worker(PipelineWorker(0, 0));
  EXPECT_TRUE(watch.Record(moved, PipelineWorker(0, 2), Received(30.0, 0.02)).empty());
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
  watch.Record(plan, PipelineWorker(0, 1), Received(std::nan(""), -1));
  EXPECT_TRUE(watch.NormsOf(PipelineWorker(0, 0)).empty());
  EXPECT_TRUE(watch.NormsOf(PipelineWorker(0, 2)).empty());
  watch.Record(plan, "stranger", Received(1.0, 0.02));
  EXPECT_TRUE(watch.NormsOf(PipelineWorker(0, 0)).empty());
}

}  // namespace
}  // namespace geotrain
