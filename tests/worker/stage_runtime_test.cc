#include "worker/stage_runtime.h"

#include "common/layer_state.h"
#include "common/plan_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <set>
#include <future>
#include <thread>

#include "common/job_spec.h"
#include "common/tensor_wire.h"
#include "tests/worker/tiny_text_job.h"
#include "worker/models.h"
#include "worker/weight_stash.h"

namespace geotrain {
namespace {

class StageRuntimeTest : public testing::Test {
 protected:
  void SetUp() override {
    // One file per process: ctest runs this binary's tests in parallel.
    corpus_ = WriteTinyCorpus("stage_runtime_corpus");
    auto job = TinyGptJob(corpus_);
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *job;
  }

  std::unique_ptr<StageRuntime> Make(int stage, int stages, int begin, int end) {
    auto runtime = StageRuntime::Create(job_, {stage, stages, begin, end}, {"cpu"});
    EXPECT_TRUE(runtime.ok()) << runtime.status();
    return std::move(*runtime);
  }

  // A 4-layer LLaMA whose head is tied to its embedding, on the corpus.
  void UseTiedLlama() {
    auto job = ParseJobSpec(
        "llama { context: 16 d_model: 32 heads: 4 kv_heads: 2 blocks: 2 tie_embeddings: true } "
        "text { paths: \"" + corpus_ + "\" } steps: 3 microbatches: 2 microbatch_size: 4 seed: 7",
        "test");
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *job;
  }

  std::string corpus_;
  v1::JobSpec job_;
};

TEST_F(StageRuntimeTest, LayerWeightsDependOnlyOnSeedAndIndex) {
  auto whole = BuildLayers(job_, 0, 4);
  auto part = BuildLayers(job_, 2, 3);
  auto a = whole[2]->parameters();
  auto b = part[0]->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i]));
  EXPECT_FALSE(torch::equal(whole[1]->named_parameters()["qkv.weight"],
                            whole[2]->named_parameters()["qkv.weight"]));
}

// Two stages exchanging messages compute the same losses, for several
// optimizer steps, as one stage holding every layer.
// Pipelines draw disjoint data indices that together cover every one, and
// a change of R with the plan's data base draws none twice.
TEST_F(StageRuntimeTest, DataShardsOfPipelinesAreDisjointAndComplete) {
  auto runtime = Make(0, 2, 0, 2);
  EXPECT_EQ(runtime->DataIndexOf(5), 5);  // one pipeline: the identity
  std::set<int64_t> drawn;
  const int m = job_.microbatches();
  for (int r = 0; r < 3; ++r) {
    runtime->SetDataShard(3, r, /*start_step=*/0, /*base=*/0);
    for (int64_t id = 0; id < 4 * m; ++id) {
      EXPECT_TRUE(drawn.insert(runtime->DataIndexOf(id)).second) << "pipeline " << r;
    }
  }
  EXPECT_EQ(*drawn.begin(), 0);
  EXPECT_EQ(*drawn.rbegin(), 3 * 4 * m - 1);  // steps 0-3 of R=3: all of [0, 12m)
  // From step 4, one pipeline (R 3 -> 1), its first index where R=3 ended.
  runtime->SetDataShard(1, 0, /*start_step=*/4, /*base=*/3 * 4 * m);
  for (int64_t id = 4 * m; id < 6 * m; ++id) {
    EXPECT_TRUE(drawn.insert(runtime->DataIndexOf(id)).second) << id;
  }
  // The message says which id it is and where its data came from.
  auto input = runtime->LoadTrainMicrobatchById(4, 4 * m);
  ASSERT_TRUE(input.ok()) << input.status();
  EXPECT_EQ(input->header.microbatch(), static_cast<uint64_t>(4 * m));
  EXPECT_FALSE(runtime->LoadTrainMicrobatchById(0, 0).ok());  // before this pipeline's data
}

// Split (OuterOptimizer.split_batch), R pipelines share each step's M
// indices: every lane draws its share of a step, evenly or not, and the
// lanes of a step together draw exactly that step's M indices.
TEST_F(StageRuntimeTest, SplitShardsShareEachStepsIndices) {
  auto runtime = Make(0, 2, 0, 2);
  for (const int m : {4, 5}) {
    for (const int pipelines : {2, 3}) {
      std::set<int64_t> drawn;
      for (int r = 0; r < pipelines; ++r) {
        const int share = SplitMicrobatches(m, pipelines, r);
        runtime->SetDataShard(pipelines, r, /*start_step=*/2, /*base=*/2 * m, share, m);
        for (int step = 2; step < 5; ++step) {
          for (int j = 0; j < share; ++j) {
            const int64_t index = runtime->DataIndexOf(int64_t{step} * share + j);
            EXPECT_GE(index, int64_t{step} * m) << m << " " << pipelines << " " << r;
            EXPECT_LT(index, int64_t{step + 1} * m) << m << " " << pipelines << " " << r;
            EXPECT_TRUE(drawn.insert(index).second) << m << " " << pipelines << " " << r;
          }
        }
      }
      // Steps 2-4 of the job: exactly [2m, 5m).
      EXPECT_EQ(drawn.size(), 3u * m);
      EXPECT_EQ(*drawn.begin(), 2 * m);
      EXPECT_EQ(*drawn.rbegin(), 5 * m - 1);
    }
  }
  // LoadTrainMicrobatch counts this lane's share a step.
  runtime->SetDataShard(2, 1, 0, 0, /*microbatches=*/2, /*block=*/4);
  auto input = runtime->LoadTrainMicrobatch(3, 1);
  ASSERT_TRUE(input.ok()) << input.status();
  EXPECT_EQ(input->header.microbatch(), 3u * 2 + 1);
}

TEST_F(StageRuntimeTest, TwoStagesMatchOneStage) {
  auto single = Make(0, 1, 0, 4);
  auto first = Make(0, 2, 0, 2);
  auto second = Make(1, 2, 2, 4);
  for (int step = 0; step < job_.steps(); ++step) {
    for (int mb = 0; mb < job_.microbatches(); ++mb) {
      auto input = single->LoadTrainMicrobatch(step, mb);
      ASSERT_TRUE(input.ok());
      auto reference = single->ForwardLoss(*input);
      ASSERT_TRUE(reference.ok()) << reference.status();
      EXPECT_FALSE(reference->gradient.has_value()) << "stage 0 has no upstream";

      auto activation = first->Forward(*first->LoadTrainMicrobatch(step, mb));
      ASSERT_TRUE(activation.ok()) << activation.status();
      EXPECT_EQ(first->pending_microbatches(), 1u);
      auto result = second->ForwardLoss(*activation);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_NEAR(result->loss, reference->loss, 1e-5 * std::abs(reference->loss));
      ASSERT_TRUE(result->gradient.has_value());
      auto upstream = first->Backward(*result->gradient);
      ASSERT_TRUE(upstream.ok()) << upstream.status();
      EXPECT_FALSE(upstream->has_value());
      EXPECT_EQ(first->pending_microbatches(), 0u);
    }
    ASSERT_TRUE(single->ApplyUpdate().ok());
    ASSERT_TRUE(first->ApplyUpdate().ok());
    ASSERT_TRUE(second->ApplyUpdate().ok());
  }
}

// Tied embeddings: the first stage's embedding and the last stage's head
// are copies of one matrix. Trading their gradient sums at each update keeps
// the copies bit-equal, and two stages train as one stage holding both.
TEST_F(StageRuntimeTest, TiedEmbeddingCopiesStayEqualAndTwoStagesMatchOne) {
  ASSERT_NO_FATAL_FAILURE(UseTiedLlama());
  auto single = Make(0, 1, 0, 4);
  auto first = Make(0, 2, 0, 2);
  auto second = Make(1, 2, 2, 4);
  EXPECT_FALSE(single->holds_one_tied_end());
  EXPECT_TRUE(first->holds_one_tied_end());
  EXPECT_TRUE(second->holds_one_tied_end());
  EXPECT_EQ(StageRuntime::TiedEmbeddingBytes(job_), 256u * 32 * 4);
  // The tied matrix of each runtime: the embedding's (layer 0, its only
  // parameter) or the head's (its second, after the norm).
  auto matrix = [](StageRuntime& runtime, bool head) {
    auto weights = runtime.ExportWeights(WireEncoding{});
    EXPECT_TRUE(weights.ok()) << weights.status();
    const v1::LayerWeights& layer = head ? weights->back() : weights->front();
    const uint64_t offset = head ? layer.params(0).payload_bytes() : 0;
    return layer.payload().substr(offset, layer.params(head ? 1 : 0).payload_bytes());
  };
  EXPECT_EQ(matrix(*first, false), matrix(*second, true)) << "the head starts as the embedding";

  for (int step = 0; step < job_.steps(); ++step) {
    for (int mb = 0; mb < job_.microbatches(); ++mb) {
      auto reference = single->ForwardLoss(*single->LoadTrainMicrobatch(step, mb));
      ASSERT_TRUE(reference.ok()) << reference.status();
      auto activation = first->Forward(*first->LoadTrainMicrobatch(step, mb));
      ASSERT_TRUE(activation.ok()) << activation.status();
      auto result = second->ForwardLoss(*activation);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_NEAR(result->loss, reference->loss, 1e-5 * std::abs(reference->loss)) << step;
      ASSERT_TRUE(first->Backward(*result->gradient).ok());
    }
    ASSERT_TRUE(single->ApplyUpdate(0.5).ok());
    // Each end hands its sum over and waits for the other's, as the two
    // workers do over TiedEmbedding.
    std::promise<std::string> to_first, to_second;
    auto exchange = [](std::promise<std::string>& out, std::promise<std::string>& in) {
      return [&out, &in](std::string_view mine) -> absl::StatusOr<std::string> {
        out.set_value(std::string(mine));
        return in.get_future().get();
      };
    };
    absl::Status first_updated;
    std::thread other([&] { first_updated = first->ApplyUpdate(0.5, exchange(to_second, to_first)); });
    const absl::Status second_updated = second->ApplyUpdate(0.5, exchange(to_first, to_second));
    other.join();
    ASSERT_TRUE(first_updated.ok()) << first_updated;
    ASSERT_TRUE(second_updated.ok()) << second_updated;
    EXPECT_EQ(matrix(*first, false), matrix(*second, true)) << "after step " << step;
    EXPECT_EQ(matrix(*single, false), matrix(*single, true)) << "after step " << step;
    EXPECT_EQ(matrix(*single, false), matrix(*first, false)) << "after step " << step;
  }
}

// A stage holding one end cannot update alone: its copy would drift.
TEST_F(StageRuntimeTest, ATiedEndWithoutItsPeerDoesNotUpdate) {
  ASSERT_NO_FATAL_FAILURE(UseTiedLlama());
  auto second = Make(1, 2, 2, 4);
  auto first = Make(0, 2, 0, 2);
  auto result = second->ForwardLoss(*first->Forward(*first->LoadTrainMicrobatch(0, 0)));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(second->ApplyUpdate(0.5).code(), absl::StatusCode::kFailedPrecondition);
  // A peer's sum of the wrong size is refused.
  auto result2 = second->ForwardLoss(*first->Forward(*first->LoadTrainMicrobatch(0, 1)));
  ASSERT_TRUE(result2.ok());
  const absl::Status short_sum = second->ApplyUpdate(
      0.5, [](std::string_view) -> absl::StatusOr<std::string> { return std::string(8, '\0'); });
  EXPECT_FALSE(short_sum.ok());
  EXPECT_NE(short_sum.message().find("not"), std::string::npos) << short_sum;
}

// The gradient a stage sends upstream is d(loss)/d(input): checked against
// a central finite difference along a random direction.
TEST_F(StageRuntimeTest, InputGradientMatchesFiniteDifference) {
  job_.set_microbatches(1);
  auto first = Make(0, 2, 0, 1);
  auto last = Make(1, 2, 1, 4);
  auto activation = first->Forward(*first->LoadTrainMicrobatch(0, 0));
  ASSERT_TRUE(activation.ok());
  auto result = last->ForwardLoss(*activation);
  ASSERT_TRUE(result.ok());
  torch::Tensor grad = *DecodeTensor(result->gradient->header.tensors(0),
                                     result->gradient->payload, 0);
  torch::Tensor x = *DecodeTensor(activation->header.tensors(0), activation->payload, 0);
  const size_t targets_offset = activation->header.tensors(0).payload_bytes();
  torch::Tensor targets =
      *DecodeTensor(activation->header.tensors(1), activation->payload, targets_offset);

  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  torch::Tensor direction = torch::randn_like(x);
  direction /= direction.norm();
  auto layers = BuildLayers(job_, 1, 4);
  // float32 throughout (as trained); eps balances truncation and rounding.
  auto loss_at = [&](const torch::Tensor& input) {
    torch::Tensor h = input;
    for (auto& layer : layers) h = layer->forward(h);
    return ComputeLoss(job_, h, targets).item<double>();
  };
  const double eps = 1e-2;
  const double numeric = (loss_at(x + eps * direction) - loss_at(x - eps * direction)) / (2 * eps);
  const double analytic = (grad * direction).sum().item<double>();
  EXPECT_NEAR(analytic, numeric, 0.02 * std::abs(numeric) + 1e-4);
}

// Message of one float tensor (and int64 targets) as stage 0 would send it.
LinkMessage ActivationMessage(uint64_t microbatch, const torch::Tensor& x, v1::MessageKind kind,
                              std::vector<int64_t> versions) {
  LinkMessage m;
  m.header.set_kind(kind);
  m.header.set_microbatch(microbatch);
  for (int64_t v : versions) m.header.add_weight_versions(v);
  EXPECT_TRUE(EncodeTensor(x, m.header.add_tensors(), &m.payload).ok());
  if (kind == v1::MESSAGE_KIND_ACTIVATION) {
    EXPECT_TRUE(EncodeTensor(torch::zeros({x.size(0), x.size(1)}, torch::kInt64),
                             m.header.add_tensors(), &m.payload)
                    .ok());
  }
  return m;
}

torch::Tensor FirstTensor(const LinkMessage& m) {
  return *DecodeTensor(m.header.tensors(0), m.payload, 0);
}

// d(<seed, layers(x)>)/dx with the given layers' own (initial) weights.
torch::Tensor RecomputeInputGradient(const std::vector<std::shared_ptr<Layer>>& layers,
                                     torch::Tensor x, const torch::Tensor& seed) {
  x = x.clone().requires_grad_(true);
  torch::Tensor y = x;
  for (const auto& layer : layers) y = layer->forward(y);
  return torch::autograd::grad({y}, {x}, {seed})[0];
}

// A middle stage runs microbatch A's forward on version 0, then an update
// makes version 1, then A's backward runs: its gradient must be the one
// recomputed from version 0's weights (the stash), not from version 1's.
TEST_F(StageRuntimeTest, BackwardUsesTheStashedWeightsOfItsForward) {
  auto middle = Make(1, 3, 1, 3);
  torch::manual_seed(11);
  const torch::Tensor xa = torch::randn({4, 16, 32});
  const torch::Tensor xb = torch::randn({4, 16, 32});
  const torch::Tensor xc = torch::randn({4, 16, 32});
  auto out_a = middle->Forward(ActivationMessage(1, xa, v1::MESSAGE_KIND_ACTIVATION, {0}));
  auto out_b = middle->Forward(ActivationMessage(2, xb, v1::MESSAGE_KIND_ACTIVATION, {0}));
  ASSERT_TRUE(out_a.ok() && out_b.ok());
  EXPECT_EQ(out_a->header.weight_versions(1), 0);

  // B's backward, then an update: version 1 is current, A still holds 0.
  const torch::Tensor seed_b = torch::randn({4, 16, 32});
  auto grad_b = middle->Backward(
      ActivationMessage(2, seed_b, v1::MESSAGE_KIND_GRADIENT, {0, 0}));
  ASSERT_TRUE(grad_b.ok()) << grad_b.status();
  ASSERT_TRUE(middle->ApplyUpdate().ok());
  StashStats stats = middle->stash_stats();
  EXPECT_EQ(stats.current_version, 1);
  EXPECT_EQ(stats.versions_alive, 2);
  auto out_c = middle->Forward(ActivationMessage(3, xc, v1::MESSAGE_KIND_ACTIVATION, {0}));
  ASSERT_TRUE(out_c.ok());
  EXPECT_EQ(out_c->header.weight_versions(1), 1);

  const auto version0 = BuildLayers(job_, 1, 3);  // the initial weights
  const torch::Tensor seed_a = torch::randn({4, 16, 32});
  auto grad_a = middle->Backward(
      ActivationMessage(1, seed_a, v1::MESSAGE_KIND_GRADIENT, {0, 0}));
  ASSERT_TRUE(grad_a.ok()) << grad_a.status();
  EXPECT_TRUE(torch::allclose(FirstTensor(**grad_a),
                              RecomputeInputGradient(version0, xa, seed_a), 1e-5, 1e-6));
  stats = middle->stash_stats();
  EXPECT_EQ(stats.versions_alive, 1) << "version 0 freed with its last microbatch";
  EXPECT_EQ(stats.staleness_max, 1);

  // C ran on version 1, whose weights differ: the version-0 recomputation
  // does not match it, so the check above can tell versions apart.
  const torch::Tensor seed_c = torch::randn({4, 16, 32});
  auto grad_c = middle->Backward(
      ActivationMessage(3, seed_c, v1::MESSAGE_KIND_GRADIENT, {0, 1}));
  ASSERT_TRUE(grad_c.ok()) << grad_c.status();
  EXPECT_FALSE(torch::allclose(FirstTensor(**grad_c),
                               RecomputeInputGradient(version0, xc, seed_c), 1e-5, 1e-6));
  EXPECT_EQ(middle->stash_stats().references, 0);
}

TEST_F(StageRuntimeTest, GradientNamingAnotherVersionIsRefused) {
  auto middle = Make(1, 3, 1, 3);
  const torch::Tensor x = torch::randn({4, 16, 32});
  ASSERT_TRUE(middle->Forward(ActivationMessage(5, x, v1::MESSAGE_KIND_ACTIVATION, {0})).ok());
  auto refused = middle->Backward(
      ActivationMessage(5, torch::randn({4, 16, 32}), v1::MESSAGE_KIND_GRADIENT, {0, 7}));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(middle->stash_stats().references, 0) << "the refused microbatch is dropped";
}

TEST_F(StageRuntimeTest, TooManyVersionsIsAnError) {
  RuntimeOptions options;
  options.max_weight_versions = 1;
  auto middle = std::move(*StageRuntime::Create(job_, {1, 3, 1, 3}, options));
  const torch::Tensor x = torch::randn({4, 16, 32});
  ASSERT_TRUE(middle->Forward(ActivationMessage(1, x, v1::MESSAGE_KIND_ACTIVATION, {0})).ok());
  ASSERT_TRUE(middle->Forward(ActivationMessage(2, x, v1::MESSAGE_KIND_ACTIVATION, {0})).ok());
  ASSERT_TRUE(middle
                  ->Backward(ActivationMessage(1, torch::randn({4, 16, 32}),
                                               v1::MESSAGE_KIND_GRADIENT, {0, 0}))
                  .ok());
  EXPECT_EQ(middle->ApplyUpdate().code(), absl::StatusCode::kInternal);
}

TEST_F(StageRuntimeTest, GradientForUnknownMicrobatchIsRefused) {
  auto first = Make(0, 2, 0, 2);
  LinkMessage gradient;
  gradient.header.set_kind(v1::MESSAGE_KIND_GRADIENT);
  gradient.header.set_microbatch(99);
  EXPECT_EQ(first->Backward(gradient).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StageRuntimeTest, MalformedTensorIsAnErrorNotACrash) {
  auto second = Make(1, 2, 2, 4);
  LinkMessage bad;
  bad.header.set_kind(v1::MESSAGE_KIND_ACTIVATION);
  v1::TensorHeader* t = bad.header.add_tensors();
  t->add_shape(4);
  t->add_shape(16);
  t->add_shape(31);  // wrong width: the layer's matmul throws inside LibTorch
  t->set_dtype(v1::DTYPE_FLOAT32);
  t->set_codec(v1::CODEC_NONE);
  t->set_payload_bytes(4 * 16 * 31 * 4);
  bad.payload.assign(4 * 16 * 31 * 4, '\0');
  v1::TensorHeader* targets = bad.header.add_tensors();
  targets->add_shape(4);
  targets->add_shape(16);
  targets->set_dtype(v1::DTYPE_INT64);
  targets->set_codec(v1::CODEC_NONE);
  targets->set_payload_bytes(4 * 16 * 8);
  bad.payload.append(4 * 16 * 8, '\0');
  auto result = second->ForwardLoss(bad);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInternal);
}

TEST_F(StageRuntimeTest, EvaluationAveragesOverElements) {
  auto single = Make(0, 1, 0, 4);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(single->EvalForward(*single->LoadEvalMicrobatch(i)).ok());
  EvalResult result = single->TakeEvalResult(0);
  EXPECT_EQ(result.samples, 12);
  EXPECT_GT(result.loss, 3.0);  // untrained byte model: near ln(256) = 5.5
  EXPECT_LT(result.accuracy, 0);
  EXPECT_EQ(single->TakeEvalResult(0).samples, 0) << "taking resets";
}

// Two passes interleaved (one held up on a paused replica) stay apart.
TEST_F(StageRuntimeTest, OverlappingEvaluationPassesDoNotMix) {
  auto single = Make(0, 1, 0, 4);
  for (int i = 0; i < 3; ++i) {
    for (int step : {10, 20}) {
      LinkMessage input = *single->LoadEvalMicrobatch(step == 10 ? i : 0);
      input.header.set_step(step);
      ASSERT_TRUE(single->EvalForward(input).ok());
    }
  }
  const EvalResult second = single->TakeEvalResult(20);
  const EvalResult first = single->TakeEvalResult(10);
  EXPECT_EQ(first.samples, 12);
  EXPECT_EQ(second.samples, 12);
  // Pass 20 saw microbatch 0 three times; pass 10 microbatches 0, 1 and 2.
  LinkMessage only = *single->LoadEvalMicrobatch(0);
  only.header.set_step(30);
  ASSERT_TRUE(single->EvalForward(only).ok());
  EXPECT_DOUBLE_EQ(second.loss, single->TakeEvalResult(30).loss);
  EXPECT_NE(first.loss, second.loss);
}

TEST_F(StageRuntimeTest, UnknownDeviceIsAnError) {
  auto runtime = StageRuntime::Create(job_, {0, 1, 0, 4}, {"tpu"});
  EXPECT_FALSE(runtime.ok());
}

// A checkpoint carries weights and optimizer state: a fresh runtime that
// restores it continues exactly like the one that wrote it.
TEST_F(StageRuntimeTest, RestoredCheckpointContinuesIdentically) {
  auto original = Make(0, 1, 0, 4);
  auto train_step = [&](StageRuntime* runtime, int step) -> double {
    double loss = 0;
    for (int mb = 0; mb < job_.microbatches(); ++mb) {
      auto result = runtime->ForwardLoss(*runtime->LoadTrainMicrobatch(step, mb));
      EXPECT_TRUE(result.ok()) << result.status();
      loss = result->loss;
    }
    EXPECT_TRUE(runtime->ApplyUpdate(0.5).ok());
    return loss;
  };
  for (int step = 0; step < 2; ++step) train_step(original.get(), step);
  auto checkpoint = original->ExportCheckpoint(2);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ASSERT_EQ(checkpoint->size(), 4u);
  EXPECT_EQ((*checkpoint)[3].layer(), 3);
  EXPECT_EQ((*checkpoint)[0].state_per_param(), 2);  // AdamW's m and v
  EXPECT_EQ((*checkpoint)[0].optimizer_steps(), 2);

  auto restored = Make(0, 1, 0, 4);
  ASSERT_TRUE(restored->RestoreCheckpoint(*checkpoint).ok());
  // Same loss on the next step, and the same after another update (which
  // needs the optimizer's moments to match too).
  const double after_restore = train_step(restored.get(), 2);
  EXPECT_DOUBLE_EQ(after_restore, train_step(original.get(), 2));
  EXPECT_DOUBLE_EQ(train_step(restored.get(), 3), train_step(original.get(), 3));

  // A fresh runtime without the checkpoint does not match: the test can tell.
  auto fresh = Make(0, 1, 0, 4);
  EXPECT_NE(train_step(fresh.get(), 2), after_restore);
}

// The checkpoint streamed from the live tensors (large stages) is the one
// ExportCheckpoint copies, byte for byte, in chunks of at most 1 MiB.
TEST_F(StageRuntimeTest, AStreamedCheckpointIsTheExportedOne) {
  auto runtime = Make(0, 1, 0, 4);
  for (int mb = 0; mb < job_.microbatches(); ++mb) {
    ASSERT_TRUE(runtime->ForwardLoss(*runtime->LoadTrainMicrobatch(0, mb)).ok());
  }
  ASSERT_TRUE(runtime->ApplyUpdate(0.5).ok());
  auto exported = runtime->ExportCheckpoint(1);
  ASSERT_TRUE(exported.ok());
  LayerStateCollector collector;
  LayerStateReceiver receiver(&collector, uint64_t{1} << 30);
  int chunks = 0;
  ASSERT_TRUE(runtime
                  ->StreamCheckpoint(1,
                                     [&](const v1::LayerStateChunk& chunk) {
                                       ++chunks;
                                       EXPECT_LE(chunk.data().size(), kLayerStateChunkBytes);
                                       return receiver.Add(chunk).ok();
                                     })
                  .ok());
  ASSERT_TRUE(receiver.Finish().ok());
  ASSERT_EQ(collector.layers().size(), exported->size());
  for (size_t i = 0; i < exported->size(); ++i) {
    EXPECT_EQ(collector.layers()[i].SerializeAsString(), (*exported)[i].SerializeAsString());
  }
  EXPECT_GE(chunks, static_cast<int>(exported->size()));
  uint64_t bytes = 0;
  for (const auto& layer : *exported) bytes += layer.payload().size();
  EXPECT_EQ(runtime->StateBytes(), bytes);
  EXPECT_EQ(runtime->StreamCheckpoint(1, [](const v1::LayerStateChunk&) { return false; }).code(),
            absl::StatusCode::kCancelled);
}

// Weights kept for audits are exported when asked, after the stage has
// moved on: exactly the version's weights-only checkpoint as it was, not
// the newer one.
TEST_F(StageRuntimeTest, WeightsExportedLaterAreTheVersionsAsItWas) {
  auto runtime = Make(0, 1, 0, 4);
  auto train_step = [&](int step) {
    for (int mb = 0; mb < job_.microbatches(); ++mb) {
      ASSERT_TRUE(runtime->ForwardLoss(*runtime->LoadTrainMicrobatch(step, mb)).ok());
    }
    ASSERT_TRUE(runtime->ApplyUpdate(0.5).ok());
  };
  train_step(0);
  auto then = runtime->ExportCheckpoint(0, /*weights_only=*/true);
  ASSERT_TRUE(then.ok());
  const std::string digest = runtime->WeightsDigest();
  StageRuntime::WeightsExport later = runtime->ExportWeightsLater();
  uint64_t bytes = 0;
  for (const auto& layer : *then) bytes += layer.payload().size();
  EXPECT_EQ(runtime->WeightBytes(), bytes);
  train_step(1);
  train_step(2);
  ASSERT_NE(runtime->WeightsDigest(), digest);
  auto exported = later();
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_EQ(exported->size(), then->size());
  for (size_t i = 0; i < then->size(); ++i) {
    EXPECT_EQ((*exported)[i].SerializeAsString(), (*then)[i].SerializeAsString()) << i;
  }
  // And they restore to the digest they had.
  auto fresh = Make(0, 1, 0, 4);
  ASSERT_TRUE(fresh->RestoreCheckpoint(*exported).ok());
  EXPECT_EQ(fresh->WeightsDigest(), digest);
}

TEST_F(StageRuntimeTest, RestoreRefusesWhatDoesNotFit) {
  auto runtime = Make(0, 2, 0, 2);
  auto other = Make(1, 2, 2, 4);
  auto foreign = other->ExportCheckpoint(0);
  ASSERT_TRUE(foreign.ok());
  // Layer 3 is not this stage's.
  EXPECT_EQ(runtime->RestoreCheckpoint({(*foreign)[1]}).code(),
            absl::StatusCode::kInvalidArgument);
  // The head's tensors (layer 3) relabelled as the embedding (layer 0) do
  // not fit.
  v1::LayerCheckpoint relabelled = (*foreign)[1];
  relabelled.set_layer(0);
  EXPECT_EQ(runtime->RestoreCheckpoint({relabelled}).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StageRuntimeTest, DropInFlightFreesStashedVersions) {
  auto first = Make(0, 2, 0, 2);
  for (int mb = 0; mb < 2; ++mb) {
    ASSERT_TRUE(first->Forward(*first->LoadTrainMicrobatch(0, mb)).ok());
  }
  EXPECT_EQ(first->pending_microbatches(), 2u);
  EXPECT_EQ(first->stash_stats().references, 2);
  EXPECT_EQ(first->DropInFlight(), 2);
  EXPECT_EQ(first->pending_microbatches(), 0u);
  EXPECT_EQ(first->stash_stats().references, 0);
  EXPECT_EQ(first->stash_stats().versions_alive, 1);
}

// The weights of one stage's layers, decoded from ExportWeights (exact).
std::vector<torch::Tensor> Weights(const StageRuntime& runtime) {
  auto layers = runtime.ExportWeights({});
  EXPECT_TRUE(layers.ok()) << layers.status();
  std::vector<torch::Tensor> out;
  for (const v1::LayerWeights& layer : *layers) {
    size_t offset = 0;
    for (const v1::TensorHeader& header : layer.params()) {
      out.push_back(*DecodeTensor(header, layer.payload(), offset));
      offset += header.payload_bytes();
    }
  }
  return out;
}

TEST_F(StageRuntimeTest, ReplicasAverageTheirWeights) {
  auto a = Make(0, 1, 0, 4), b = Make(0, 1, 0, 4);
  auto train = [&](StageRuntime* runtime, int step) {
    for (int mb = 0; mb < job_.microbatches(); ++mb) {
      ASSERT_TRUE(runtime->ForwardLoss(*runtime->LoadTrainMicrobatch(step, mb)).ok());
    }
    ASSERT_TRUE(runtime->ApplyUpdate(0.5).ok());
  };
  train(a.get(), 0);  // different data: the replicas drift apart
  train(b.get(), 1);
  const std::vector<torch::Tensor> wa = Weights(*a), wb = Weights(*b);
  ASSERT_FALSE(torch::equal(wa[0], wb[0]));

  WireEncoding fp16;
  fp16.codec = v1::CODEC_FP16;
  auto from_b = b->ExportWeights(fp16);
  ASSERT_TRUE(from_b.ok()) << from_b.status();
  ASSERT_EQ(from_b->size(), 4u);
  const int64_t version = a->stash_stats().current_version;
  ASSERT_TRUE(a->AverageWeights(*from_b).ok());
  EXPECT_EQ(a->stash_stats().current_version, version + 1);
  const std::vector<torch::Tensor> averaged = Weights(*a);
  ASSERT_EQ(averaged.size(), wa.size());
  for (size_t i = 0; i < wa.size(); ++i) {
    // fp16 on the wire: within half a unit of its last place.
    EXPECT_TRUE(torch::allclose(averaged[i], (wa[i] + wb[i]) / 2, 1e-3, 1e-3)) << i;
  }
  // A replica catching up takes the sibling's weights instead.
  ASSERT_TRUE(a->AverageWeights(*b->ExportWeights({}), /*adopt=*/true).ok());
  const std::vector<torch::Tensor> adopted = Weights(*a);
  for (size_t i = 0; i < wb.size(); ++i) EXPECT_TRUE(torch::equal(adopted[i], wb[i])) << i;
}

TEST_F(StageRuntimeTest, AveragingLeavesMicrobatchesInFlightOnTheirVersion) {
  auto first = Make(0, 2, 0, 2), second = Make(1, 2, 2, 4);
  auto other = Make(0, 2, 0, 2);
  for (int mb = 0; mb < 2; ++mb) {  // the other replica moves away
    auto result = second->ForwardLoss(*other->Forward(*other->LoadTrainMicrobatch(0, mb)));
    ASSERT_TRUE(other->Backward(*result->gradient).ok());
  }
  ASSERT_TRUE(other->ApplyUpdate(0.5).ok());
  auto activation = first->Forward(*first->LoadTrainMicrobatch(1, 0));
  ASSERT_TRUE(activation.ok());
  ASSERT_TRUE(first->AverageWeights(*other->ExportWeights({})).ok());
  // The backward checks it differentiates the version its forward used.
  auto result = second->ForwardLoss(*activation);
  ASSERT_TRUE(result.ok()) << result.status();
  auto back = first->Backward(*result->gradient);
  EXPECT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(first->stash_stats().references, 0);
}

TEST_F(StageRuntimeTest, AveragingRefusesWhatDoesNotFitAndChangesNothing) {
  auto runtime = Make(0, 2, 0, 2);
  auto other = Make(1, 2, 2, 4);
  auto foreign = other->ExportWeights({});
  ASSERT_TRUE(foreign.ok());
  const int64_t version = runtime->stash_stats().current_version;
  EXPECT_EQ(runtime->AverageWeights({(*foreign)[0]}).code(), absl::StatusCode::kInvalidArgument);
  v1::LayerWeights relabelled = (*foreign)[1];  // the head's tensors as the embedding
  relabelled.set_layer(0);
  EXPECT_EQ(runtime->AverageWeights({relabelled}).code(), absl::StatusCode::kInvalidArgument);
  v1::LayerWeights truncated = (*runtime->ExportWeights({}))[0];
  truncated.mutable_payload()->resize(truncated.payload().size() / 2);
  EXPECT_FALSE(runtime->AverageWeights({truncated}).ok());
  EXPECT_EQ(runtime->stash_stats().current_version, version);
}

}  // namespace
}  // namespace geotrain

namespace geotrain {
namespace {

// The targets' bytes within a message (tensor 1).
std::string TargetBytes(const LinkMessage& m) {
  const size_t offset = m.header.tensors(0).payload_bytes();
  return m.payload.substr(offset, m.header.tensors(1).payload_bytes());
}

// Today's path, the reference: targets decoded and encoded again at each
// stage, zstd'd whenever the link compresses.
std::pair<std::string, std::string> ReencodedTargets(const LinkMessage& in, v1::Codec codec) {
  auto targets = DecodeTensor(in.header.tensors(1), in.payload, in.header.tensors(0).payload_bytes());
  EXPECT_TRUE(targets.ok()) << targets.status();
  WireEncoding encoding;
  encoding.zstd = codec != v1::CODEC_NONE;
  v1::TensorHeader header;
  std::string bytes;
  EXPECT_TRUE(EncodeTensor(*targets, &header, &bytes, encoding).ok());
  return {header.SerializeAsString(), bytes};
}

// Targets now stay on the host and pass through middle stages as bytes;
// the messages must be exactly what decoding and re-encoding them gave.
TEST_F(StageRuntimeTest, HostSideTargetsGiveTodaysMessages) {
  for (const auto& [first_codec, middle_codec] :
       {std::pair{v1::CODEC_NONE, v1::CODEC_NONE}, std::pair{v1::CODEC_INT8, v1::CODEC_INT8},
        std::pair{v1::CODEC_NONE, v1::CODEC_INT8}, std::pair{v1::CODEC_INT8, v1::CODEC_NONE}}) {
    RuntimeOptions first_options{"cpu"}, middle_options{"cpu"};
    first_options.activation_encoding.codec = first_codec;
    middle_options.activation_encoding.codec = middle_codec;
    auto first = StageRuntime::Create(job_, {0, 3, 0, 1}, first_options);
    auto middle = StageRuntime::Create(job_, {1, 3, 1, 3}, middle_options);
    auto last = Make(2, 3, 3, 4);
    ASSERT_TRUE(first.ok() && middle.ok());
    auto input = (*first)->LoadTrainMicrobatch(0, 0);
    ASSERT_TRUE(input.ok());
    auto a = (*first)->Forward(*input);
    ASSERT_TRUE(a.ok()) << a.status();
    auto [a_header, a_bytes] = ReencodedTargets(*input, first_codec);
    EXPECT_EQ(a->header.tensors(1).SerializeAsString(), a_header);
    EXPECT_EQ(TargetBytes(*a), a_bytes);
    auto b = (*middle)->Forward(*a);
    ASSERT_TRUE(b.ok()) << b.status();
    auto [b_header, b_bytes] = ReencodedTargets(*a, middle_codec);
    EXPECT_EQ(b->header.tensors(1).SerializeAsString(), b_header);
    EXPECT_EQ(TargetBytes(*b), b_bytes);
    // The last stage reads them for the loss.
    auto result = last->ForwardLoss(*b);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_GT(result->loss, 0);
  }
}

// The stage that uses the targets checks them, on the host.
TEST_F(StageRuntimeTest, TargetsOutOfRangeAreRefusedWhereTheyAreUsed) {
  auto single = Make(0, 1, 0, 4);
  auto input = single->LoadTrainMicrobatch(0, 0);
  ASSERT_TRUE(input.ok());
  LinkMessage bad = *input;
  const size_t offset = bad.header.tensors(0).payload_bytes();
  const int64_t out_of_range = 100000;
  std::memcpy(&bad.payload[offset], &out_of_range, sizeof(out_of_range));
  auto result = single->ForwardLoss(bad);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("targets out of range"), std::string::npos);
  EXPECT_TRUE(single->ForwardLoss(*input).ok());
}

}  // namespace
}  // namespace geotrain
