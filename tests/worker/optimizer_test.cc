#include "worker/optimizer.h"

#include <gtest/gtest.h>

namespace geotrain {
namespace {

// The out-of-place optimizers follow LibTorch's own, step for step, and never
// touch the tensors they are given.
TEST(OptimizerTest, AdamWMatchesLibTorchAndIsOutOfPlace) {
  v1::Optimizer spec;
  spec.set_kind(v1::Optimizer::KIND_ADAMW);
  spec.set_lr(0.01);
  spec.set_beta1(0.9);
  spec.set_beta2(0.999);
  spec.set_weight_decay(0.1);
  torch::manual_seed(0);
  torch::Tensor reference = torch::randn({5, 3}).requires_grad_(true);
  torch::optim::AdamW torch_adamw({reference}, torch::optim::AdamWOptions(0.01)
                                                   .betas({0.9, 0.999})
                                                   .weight_decay(0.1));
  std::vector<torch::Tensor> ours = {reference.detach().clone()};
  auto optimizer = MakeOptimizer(spec);
  for (int step = 0; step < 5; ++step) {
    torch::Tensor grad = torch::randn({5, 3});
    reference.mutable_grad() = grad.clone();
    torch_adamw.step();
    const torch::Tensor before = ours[0].clone();
    std::vector<torch::Tensor> next = optimizer->Step(ours, {grad});
    EXPECT_TRUE(torch::equal(ours[0], before)) << "input modified at step " << step;
    ours = next;
    EXPECT_TRUE(torch::allclose(ours[0], reference.detach(), 1e-5, 1e-6)) << "step " << step;
  }
}

TEST(OptimizerTest, SgdWithMomentumMatchesLibTorch) {
  v1::Optimizer spec;
  spec.set_kind(v1::Optimizer::KIND_SGD);
  spec.set_lr(0.1);
  spec.set_momentum(0.9);
  spec.set_weight_decay(0.01);
  torch::manual_seed(1);
  torch::Tensor reference = torch::randn({7}).requires_grad_(true);
  torch::optim::SGD torch_sgd({reference},
                              torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  std::vector<torch::Tensor> ours = {reference.detach().clone()};
  auto optimizer = MakeOptimizer(spec);
  for (int step = 0; step < 5; ++step) {
    torch::Tensor grad = torch::randn({7});
    reference.mutable_grad() = grad.clone();
    torch_sgd.step();
    ours = optimizer->Step(ours, {grad});
    EXPECT_TRUE(torch::allclose(ours[0], reference.detach(), 1e-5, 1e-6)) << "step " << step;
  }
}

// The state a Step() leaves is new tensors too: what State() returned
// before it is unchanged, so a spot check holds a version's optimizer state
// by reference (StageRuntime::ExportWeightsLater).
TEST(OptimizerTest, StateHeldFromBeforeAStepIsUnchangedByIt) {
  for (const v1::Optimizer::Kind kind : {v1::Optimizer::KIND_ADAMW, v1::Optimizer::KIND_SGD}) {
    v1::Optimizer spec;
    spec.set_kind(kind);
    spec.set_lr(0.01);
    spec.set_beta1(0.9);
    spec.set_beta2(0.999);
    spec.set_momentum(0.9);
    torch::manual_seed(2);
    std::vector<torch::Tensor> params = {torch::randn({4, 3})};
    auto optimizer = MakeOptimizer(spec);
    params = optimizer->Step(params, {torch::randn({4, 3})});
    const std::vector<std::vector<torch::Tensor>> held = optimizer->State();
    ASSERT_FALSE(held.empty());
    std::vector<torch::Tensor> copies;
    for (const torch::Tensor& t : held[0]) copies.push_back(t.clone());
    params = optimizer->Step(params, {torch::randn({4, 3})});
    for (size_t k = 0; k < copies.size(); ++k) {
      EXPECT_TRUE(torch::equal(held[0][k], copies[k])) << "kind " << kind << ", state " << k;
      EXPECT_FALSE(torch::equal(optimizer->State()[0][k], copies[k])) << "the state moved on";
    }
  }
}

TEST(LearningRateScaleTest, WarmupThenCosine) {
  v1::Optimizer spec;
  EXPECT_DOUBLE_EQ(LearningRateScale(spec, 0.3), 1.0) << "constant by default";
  spec.set_warmup_fraction(0.1);
  spec.set_decay(v1::Optimizer::DECAY_COSINE);
  spec.set_min_lr_fraction(0.1);
  EXPECT_DOUBLE_EQ(LearningRateScale(spec, 0.0), 0.0);
  EXPECT_DOUBLE_EQ(LearningRateScale(spec, 0.05), 0.5);
  EXPECT_DOUBLE_EQ(LearningRateScale(spec, 0.1), 1.0);
  EXPECT_NEAR(LearningRateScale(spec, 0.55), 0.55, 1e-12) << "half way down the cosine";
  EXPECT_NEAR(LearningRateScale(spec, 1.0), 0.1, 1e-12);
  EXPECT_NEAR(LearningRateScale(spec, 7.0), 0.1, 1e-12) << "clamped";
}

TEST(OptimizerTest, LearningRateScaleScalesTheStep) {
  v1::Optimizer spec;
  spec.set_kind(v1::Optimizer::KIND_SGD);
  spec.set_lr(1.0);
  auto optimizer = MakeOptimizer(spec);
  std::vector<torch::Tensor> next =
      optimizer->Step({torch::ones({3})}, {torch::ones({3})}, 0.25);
  EXPECT_TRUE(torch::allclose(next[0], torch::full({3}, 0.75)));
}

}  // namespace
}  // namespace geotrain
