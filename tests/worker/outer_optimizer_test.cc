// The outer optimizer (DiLoCo's outer step between a stage's replicas in
// other pipelines): its maths on hand-computed values, its refusals, error
// feedback, and through StageRuntime: replicas that end a round on
// bit-identical weights, and R pipelines with H = 1, outer lr 1 and
// momentum 0 that train exactly one pipeline with R times the batch. The
// comparison with PyTorch is tests/worker/test_outer_step_reference.py.
#include "worker/outer_optimizer.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/job_spec.h"
#include "common/model_profile.h"
#include "worker/stage_runtime.h"

namespace geotrain {
namespace {

torch::Tensor T(std::vector<float> values) { return torch::tensor(values); }

void ExpectNear(const torch::Tensor& got, std::vector<float> want, double tolerance = 1e-6) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i].item<float>(), want[i], tolerance) << "element " << i;
  }
}

TEST(OuterOptimizerTest, NesterovOnTheSamplesWeightedMean) {
  OuterOptimizer outer({/*lr=*/0.5, /*momentum=*/0.9, /*nesterov=*/true});
  outer.Reset({T({1, 2})});
  // Means weighted 1:3: [0.5, 0.1].
  auto first = outer.Step({{1, 3, {T({0.6f, 0.0f})}}, {0, 1, {T({0.2f, 0.4f})}}});
  ASSERT_TRUE(first.ok()) << first.status();
  // b = 0.5,0.1; update = mean + 0.9 b = 0.95,0.19.
  ExpectNear((*first)[0], {1 - 0.475f, 2 - 0.095f});
  ExpectNear(outer.momentum()[0], {0.5f, 0.1f});
  auto second = outer.Step({{0, 5, {T({0.1f, 0.1f})}}});
  ASSERT_TRUE(second.ok());
  // b = 0.9 b + 0.1 = 0.55,0.19; update = 0.1 + 0.9 b = 0.595,0.271.
  ExpectNear((*second)[0], {1 - 0.475f - 0.2975f, 2 - 0.095f - 0.1355f});
  EXPECT_EQ(outer.rounds(), 2);
}

TEST(OuterOptimizerTest, LearningRateOneWithoutMomentumAveragesTheReplicas) {
  OuterOptimizer outer({1.0, 0.0, true});
  outer.Reset({T({1, 1})});
  auto a = outer.PseudoGradient({T({0, 3})});  // a replica that moved to 0,3
  auto b = outer.PseudoGradient({T({2, 1})});
  ASSERT_TRUE(a.ok() && b.ok());
  auto stepped = outer.Step({{0, 1, *a}, {1, 1, *b}});
  ASSERT_TRUE(stepped.ok());
  ExpectNear((*stepped)[0], {1, 2});
}

TEST(OuterOptimizerTest, RefusesWhatDoesNotFitAndChangesNothing) {
  OuterOptimizer outer({0.7, 0.9, true});
  EXPECT_EQ(outer.PseudoGradient({T({1})}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  outer.Reset({T({1, 2})});
  EXPECT_EQ(outer.Step({{0, 1, {T({1, 2, 3})}}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(outer.Step({{0, 1, {T({1.0f, std::nanf("")})}}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(outer.Step({{0, -1, {T({1, 2})}}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(outer.rounds(), 0);
  ExpectNear(outer.outer_weights()[0], {1, 2});
  // A round in which nobody contributed samples leaves the weights.
  auto idle = outer.Step({{0, 0, {T({5, 5})}}});
  ASSERT_TRUE(idle.ok());
  ExpectNear((*idle)[0], {1, 2});
}

TEST(OuterOptimizerTest, ErrorFeedbackLosesNothingForGood) {
  WireEncoding encoding;
  encoding.codec = v1::CODEC_INT4;
  encoding.block_size = 8;
  ErrorFeedbackEncoder encoder(encoding);
  torch::manual_seed(1);
  const torch::Tensor value = torch::randn({64});
  torch::Tensor sent_sum = torch::zeros({64});
  const int rounds = 20;
  for (int round = 0; round < rounds; ++round) {
    v1::TensorHeader header;
    std::string payload;
    ASSERT_TRUE(encoder.Encode(0, value, &header, &payload).ok());
    absl::StatusOr<at::Tensor> sent = DecodeTensor(header, payload, 0);
    ASSERT_TRUE(sent.ok());
    sent_sum += *sent;
  }
  // What was sent in all equals what was meant, but for the last residual
  // (one round's quantisation error), not rounds times it.
  const double drift = (sent_sum - value * rounds).abs().max().item<double>();
  const double one_round = value.abs().max().item<double>() / 14 * 2;
  EXPECT_LT(drift, one_round);
  EXPECT_TRUE(encoder.residual(0).defined());
}

v1::JobSpec Job(int microbatches, v1::Optimizer::Kind kind) {
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(
      "gpt { context: 8 d_model: 16 heads: 2 blocks: 1 } text {} steps: 10 microbatch_size: 2 "
      "seed: 9 schedule: SCHEDULE_SYNC",
      "outer_test");
  EXPECT_TRUE(job.ok()) << job.status();
  job->set_microbatches(microbatches);
  job->mutable_optimizer()->set_kind(kind);
  job->mutable_optimizer()->set_lr(kind == v1::Optimizer::KIND_SGD ? 0.1 : 0.003);
  return *job;
}

std::unique_ptr<StageRuntime> Runtime(const v1::JobSpec& job) {
  auto runtime = StageRuntime::Create(job, {0, 1, 0, NumLayers(job)}, RuntimeOptions());
  EXPECT_TRUE(runtime.ok()) << runtime.status();
  return *std::move(runtime);
}

// `count` runtimes of `job` with the outer optimizer started, codec `codec`.
std::vector<std::unique_ptr<StageRuntime>> OuterReplicas(const v1::JobSpec& job, v1::Codec codec,
                                                         int count) {
  std::vector<std::unique_ptr<StageRuntime>> replicas;
  for (int r = 0; r < count; ++r) {
    replicas.push_back(Runtime(job));
    StageRuntime::OuterSettings settings;
    settings.encoding.codec = codec;
    EXPECT_TRUE(replicas.back()->StartOuter(settings).ok());
  }
  return replicas;
}

// One inner step of pipeline r of R on ids step*R*M + j*R + r; its mean loss.
double InnerStep(StageRuntime& runtime, const v1::JobSpec& job, int step, int r, int pipelines) {
  double loss = 0;
  for (int j = 0; j < job.microbatches(); ++j) {
    const int64_t id = static_cast<int64_t>(step) * pipelines * job.microbatches() +
                       j * pipelines + r;
    auto result = runtime.ForwardLoss(*runtime.LoadTrainMicrobatchById(step, id));
    EXPECT_TRUE(result.ok()) << result.status();
    loss += result->loss;
  }
  EXPECT_TRUE(runtime.ApplyUpdate().ok());
  return loss / job.microbatches();
}

TEST(OuterStepRuntimeTest, ReplicasEndEveryRoundBitIdentical) {
  for (v1::Codec codec : {v1::CODEC_NONE, v1::CODEC_INT8}) {
    const v1::JobSpec job = Job(2, v1::Optimizer::KIND_ADAMW);
    std::vector<std::unique_ptr<StageRuntime>> replicas = OuterReplicas(job, codec, 3);
    for (int round = 0; round < 3; ++round) {
      std::vector<StageRuntime::OuterContribution> contributions;
      for (int r = 0; r < 3; ++r) {
        for (int k = 0; k < 2; ++k) InnerStep(*replicas[r], job, round * 2 + k, r, 3);
        auto delta = replicas[r]->ExportPseudoGradient();
        ASSERT_TRUE(delta.ok()) << delta.status();
        contributions.push_back({r, 4 + r, *delta});  // unequal weights
      }
      EXPECT_NE(replicas[0]->WeightsDigest(), replicas[1]->WeightsDigest());
      // Each replica gets the contributions in its own order.
      for (int r = 0; r < 3; ++r) {
        std::rotate(contributions.begin(), contributions.begin() + 1, contributions.end());
        ASSERT_TRUE(replicas[r]->ApplyOuterStep(contributions).ok());
      }
      EXPECT_EQ(replicas[0]->WeightsDigest(), replicas[1]->WeightsDigest()) << "round " << round;
      EXPECT_EQ(replicas[0]->WeightsDigest(), replicas[2]->WeightsDigest()) << "round " << round;
      EXPECT_EQ(replicas[0]->OuterWeightsDigest(), replicas[0]->WeightsDigest());
      EXPECT_EQ(replicas[2]->outer_rounds(), round + 1);
    }
  }
}

// Through a reducer (outer_sync.h): its encoded mean, applied by every
// replica, leaves them bit-identical; without a codec it is the same step
// as ApplyOuterStep's.
TEST(OuterStepRuntimeTest, AReducersMeanLeavesEveryReplicaIdentical) {
  for (v1::Codec codec : {v1::CODEC_NONE, v1::CODEC_INT8}) {
    const v1::JobSpec job = Job(2, v1::Optimizer::KIND_ADAMW);
    std::vector<std::unique_ptr<StageRuntime>> replicas = OuterReplicas(job, codec, 3);
    // ApplyOuterStep with the same contributions.
    std::unique_ptr<StageRuntime> direct = std::move(OuterReplicas(job, codec, 1)[0]);
    for (int round = 0; round < 2; ++round) {
      std::vector<StageRuntime::OuterContribution> contributions;
      for (int r = 0; r < 3; ++r) {
        InnerStep(*replicas[r], job, round, r, 3);
        auto delta = replicas[r]->ExportPseudoGradient();
        ASSERT_TRUE(delta.ok());
        contributions.push_back({r, 8, *delta});
      }
      auto mean = replicas[0]->ReduceOuterContributions(contributions);
      ASSERT_TRUE(mean.ok()) << mean.status();
      for (auto& r : replicas) ASSERT_TRUE(r->ApplyOuterMean(*mean).ok());
      EXPECT_EQ(replicas[0]->WeightsDigest(), replicas[1]->WeightsDigest());
      EXPECT_EQ(replicas[0]->WeightsDigest(), replicas[2]->WeightsDigest());
      ASSERT_TRUE(direct->ApplyOuterStep(contributions).ok());
      if (codec == v1::CODEC_NONE) {
        EXPECT_EQ(direct->OuterWeightsDigest(), replicas[1]->OuterWeightsDigest());
      }
    }
    // A mean that misses a layer, or is not finite, changes nothing.
    auto before = replicas[1]->WeightsDigest();
    EXPECT_EQ(replicas[1]->ApplyOuterMean({}).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(replicas[1]->WeightsDigest(), before);
  }
}

// A checkpoint holds the outer weights, momentum and rounds: a runtime
// restored from it takes the next outer step exactly as the original.
TEST(OuterStepRuntimeTest, ACheckpointResumesTheOuterOptimizerExactly) {
  const v1::JobSpec job = Job(2, v1::Optimizer::KIND_ADAMW);
  std::unique_ptr<StageRuntime> original = std::move(OuterReplicas(job, v1::CODEC_NONE, 1)[0]);
  auto round = [&](StageRuntime& runtime, int step) {
    InnerStep(runtime, job, step, 0, 1);
    auto delta = runtime.ExportPseudoGradient();
    ASSERT_TRUE(delta.ok()) << delta.status();
    ASSERT_TRUE(runtime.ApplyOuterStep({{0, 8, *delta}}).ok());
  };
  for (int step = 0; step < 2; ++step) round(*original, step);  // momentum exists
  InnerStep(*original, job, 2, 0, 1);  // and some inner progress on top
  auto checkpoint = original->ExportCheckpoint(3);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ASSERT_GT((*checkpoint)[0].outer_weights_size(), 0);
  ASSERT_EQ((*checkpoint)[0].outer_momentum_size(), (*checkpoint)[0].params_size());
  EXPECT_EQ((*checkpoint)[0].outer_rounds(), 2);

  std::unique_ptr<StageRuntime> restored = Runtime(job);
  ASSERT_TRUE(restored->RestoreCheckpoint(*checkpoint).ok());
  StageRuntime::OuterSettings settings;
  ASSERT_TRUE(restored->StartOuter(settings).ok());
  EXPECT_EQ(restored->outer_rounds(), 2);
  EXPECT_EQ(restored->OuterWeightsDigest(), original->OuterWeightsDigest());
  EXPECT_EQ(restored->WeightsDigest(), original->WeightsDigest());
  auto state = [](StageRuntime& runtime) {
    std::string bytes;
    const absl::StatusOr<std::vector<v1::LayerWeights>> layers = runtime.ExportOuterState();
    EXPECT_TRUE(layers.ok()) << layers.status();
    for (const v1::LayerWeights& l : *layers) bytes += l.SerializeAsString();
    return bytes;
  };
  EXPECT_EQ(state(*restored), state(*original));  // the momentum too
  // The next round, from the same pseudo-gradient, lands on the same bytes.
  auto delta = original->ExportPseudoGradient();
  ASSERT_TRUE(delta.ok());
  ASSERT_TRUE(original->ApplyOuterStep({{0, 8, *delta}}).ok());
  ASSERT_TRUE(restored->ApplyOuterStep({{0, 8, *delta}}).ok());
  EXPECT_EQ(restored->WeightsDigest(), original->WeightsDigest());
  // Without the outer state, a restart would restart the outer optimizer.
  std::vector<v1::LayerCheckpoint> plain = *checkpoint;
  for (v1::LayerCheckpoint& layer : plain) {
    layer.clear_outer_weights();
    layer.clear_outer_momentum();
  }
  std::unique_ptr<StageRuntime> fresh = Runtime(job);
  // (The payload keeps the outer bytes; a plain checkpoint has none.)
  ASSERT_TRUE(fresh->RestoreCheckpoint(plain).ok());
  ASSERT_TRUE(fresh->StartOuter(settings).ok());
  EXPECT_EQ(fresh->outer_rounds(), 0);
}

// With the outer optimizer, evaluations run on the outer weights: inner
// steps since the last outer step do not change them; an outer step does.
TEST(OuterStepRuntimeTest, EvaluationSeesTheOuterWeights) {
  const v1::JobSpec job = Job(2, v1::Optimizer::KIND_ADAMW);
  std::unique_ptr<StageRuntime> runtime = std::move(OuterReplicas(job, v1::CODEC_NONE, 1)[0]);
  auto eval_loss = [&](int pass) {
    auto input = runtime->LoadEvalMicrobatch(0);
    EXPECT_TRUE(input.ok()) << input.status();
    input->header.set_step(pass);
    EXPECT_TRUE(runtime->EvalForward(*input).ok());
    return runtime->TakeEvalResult(pass).loss;
  };
  const double at_start = eval_loss(1);
  InnerStep(*runtime, job, 0, 0, 1);
  InnerStep(*runtime, job, 1, 0, 1);
  EXPECT_EQ(eval_loss(2), at_start);  // the outer weights have not moved
  auto delta = runtime->ExportPseudoGradient();
  ASSERT_TRUE(delta.ok());
  ASSERT_TRUE(runtime->ApplyOuterStep({{0, 8, *delta}}).ok());
  EXPECT_NE(eval_loss(3), at_start);
}

TEST(OuterStepRuntimeTest, AppliedARoundLateKeepsTheInnerStepsSince) {
  const v1::JobSpec job = Job(2, v1::Optimizer::KIND_SGD);
  auto a = Runtime(job);
  auto b = Runtime(job);
  StageRuntime::OuterSettings settings;
  settings.lr = 1;
  settings.momentum = 0;
  ASSERT_TRUE(a->StartOuter(settings).ok());
  ASSERT_TRUE(b->StartOuter(settings).ok());
  InnerStep(*a, job, 0, 0, 2);
  InnerStep(*b, job, 0, 1, 2);
  auto da = a->ExportPseudoGradient();
  auto db = b->ExportPseudoGradient();
  ASSERT_TRUE(da.ok() && db.ok());
  // The next round's inner steps go on while the sync is on the wire.
  InnerStep(*a, job, 1, 0, 2);
  InnerStep(*b, job, 1, 1, 2);
  ASSERT_TRUE(a->ApplyOuterStep({{0, 1, *da}, {1, 1, *db}}, /*keep_local_progress=*/true).ok());
  ASSERT_TRUE(b->ApplyOuterStep({{0, 1, *da}, {1, 1, *db}}, /*keep_local_progress=*/true).ok());
  // Same outer weights; the working weights keep each one's own progress.
  EXPECT_EQ(a->OuterWeightsDigest(), b->OuterWeightsDigest());
  EXPECT_NE(a->WeightsDigest(), b->WeightsDigest());
  EXPECT_NE(a->WeightsDigest(), a->OuterWeightsDigest());
}

TEST(OuterStepRuntimeTest, OneInnerStepAtLearningRateOneIsOnePipelineWithRTimesTheBatch) {
  constexpr int kPipelines = 2, kMicrobatches = 2, kSteps = 4;
  const v1::JobSpec job = Job(kMicrobatches, v1::Optimizer::KIND_SGD);
  const v1::JobSpec wide = Job(kPipelines * kMicrobatches, v1::Optimizer::KIND_SGD);
  std::vector<std::unique_ptr<StageRuntime>> pipelines;
  for (int r = 0; r < kPipelines; ++r) {
    pipelines.push_back(Runtime(job));
    StageRuntime::OuterSettings settings;
    settings.lr = 1;
    settings.momentum = 0;
    ASSERT_TRUE(pipelines.back()->StartOuter(settings).ok());
  }
  auto single = Runtime(wide);
  for (int step = 0; step < kSteps; ++step) {
    double loss = 0;
    std::vector<StageRuntime::OuterContribution> contributions;
    for (int r = 0; r < kPipelines; ++r) {
      loss += InnerStep(*pipelines[r], job, step, r, kPipelines) / kPipelines;
      auto delta = pipelines[r]->ExportPseudoGradient();
      ASSERT_TRUE(delta.ok());
      contributions.push_back({r, kMicrobatches * job.microbatch_size(), *delta});
    }
    for (auto& p : pipelines) ASSERT_TRUE(p->ApplyOuterStep(contributions).ok());
    const double reference = InnerStep(*single, wide, step, 0, 1);
    EXPECT_NEAR(loss, reference, 1e-5 * std::abs(reference)) << "step " << step;
  }
  auto mine = pipelines[0]->ExportWeights({});
  auto theirs = single->ExportWeights({});
  ASSERT_TRUE(mine.ok() && theirs.ok());
  ASSERT_EQ(mine->size(), theirs->size());
  for (size_t l = 0; l < mine->size(); ++l) {
    size_t offset = 0;
    for (int p = 0; p < (*mine)[l].params_size(); ++p) {
      auto a = DecodeTensor((*mine)[l].params(p), (*mine)[l].payload(), offset);
      auto b = DecodeTensor((*theirs)[l].params(p), (*theirs)[l].payload(), offset);
      ASSERT_TRUE(a.ok() && b.ok());
      offset += (*mine)[l].params(p).payload_bytes();
      EXPECT_LT((*a - *b).abs().max().item<double>(), 1e-6) << "layer " << l << " param " << p;
    }
  }
}

}  // namespace
}  // namespace geotrain
