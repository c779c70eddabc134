// Trains a job as R pipelines of one stage each with the outer optimizer
// (StageRuntime's StartOuter / ExportPseudoGradient / ApplyOuterStep, the
// code a stage's replicas run), and writes the outer weights after every
// round, for tests/worker/test_outer_step_reference.py to compare with the
// same maths in PyTorch.
//
// Pipeline r of R trains, at its inner step g, the data indices
// g*R*M + j*R + r (j < M): those of a global step of R*M microbatches that
// are r modulo R, through StageRuntime::SetDataShard as the pipelines of a
// plan draw them. Each inner
// step is the sync schedule's: M forward/backwards, one AdamW (or SGD)
// update at progress (g + 1) / steps.
//
// Usage: outer_step_check --job=FILE --pipelines=R --inner_steps=H
//          --rounds=N --lr=0.7 --momentum=0.9 --out=FILE
// The output: per round, "round <n> <digest>" lines on stdout (the digest
// of each pipeline's weights, which must all be equal), and in --out, per
// round, each pipeline's weights before the outer step and the outer weights
// after it; each set is int32 count, then per tensor int32 ndim, int64 dims
// and float32 data, little-endian.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/job_spec.h"
#include "common/model_profile.h"
#include "common/tensor_wire.h"
#include "worker/stage_runtime.h"

ABSL_FLAG(std::string, job, "", "job file (textproto)");
ABSL_FLAG(int, pipelines, 2, "R");
ABSL_FLAG(int, inner_steps, 3, "H");
ABSL_FLAG(int, rounds, 2, "outer rounds");
ABSL_FLAG(double, lr, 0.7, "outer learning rate");
ABSL_FLAG(double, momentum, 0.9, "outer (Nesterov) momentum");
ABSL_FLAG(std::string, out, "", "where the final weights go");

namespace geotrain {
namespace {

int Fail(const absl::Status& status) {
  std::cerr << "outer_step_check: " << status << "\n";
  return 1;
}

absl::Status WriteWeights(const std::vector<v1::LayerWeights>& layers, std::ofstream& out) {
  std::vector<std::pair<std::vector<int64_t>, std::vector<float>>> tensors;
  for (const v1::LayerWeights& layer : layers) {
    size_t offset = 0;
    for (const v1::TensorHeader& header : layer.params()) {
      absl::StatusOr<at::Tensor> t = DecodeTensor(header, layer.payload(), offset);
      if (!t.ok()) return t.status();
      offset += header.payload_bytes();
      at::Tensor flat = t->contiguous();
      const float* data = flat.data_ptr<float>();
      tensors.push_back({flat.sizes().vec(), std::vector<float>(data, data + flat.numel())});
    }
  }
  const int32_t count = static_cast<int32_t>(tensors.size());
  out.write(reinterpret_cast<const char*>(&count), sizeof(count));
  for (const auto& [dims, values] : tensors) {
    const int32_t ndim = static_cast<int32_t>(dims.size());
    out.write(reinterpret_cast<const char*>(&ndim), sizeof(ndim));
    out.write(reinterpret_cast<const char*>(dims.data()), dims.size() * sizeof(int64_t));
    out.write(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  }
  return out ? absl::OkStatus() : absl::InternalError("cannot write the weights");
}

int Run() {
  absl::StatusOr<v1::JobSpec> job = LoadJobSpec(absl::GetFlag(FLAGS_job));
  if (!job.ok()) return Fail(job.status());
  const int pipelines = absl::GetFlag(FLAGS_pipelines);
  const int inner = absl::GetFlag(FLAGS_inner_steps);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int microbatches = job->microbatches();
  const int layers = NumLayers(*job);
  std::ofstream out(absl::GetFlag(FLAGS_out), std::ios::binary);
  if (!out) return Fail(absl::InvalidArgumentError("cannot write --out"));
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  for (int r = 0; r < pipelines; ++r) {
    absl::StatusOr<std::unique_ptr<StageRuntime>> runtime =
        StageRuntime::Create(*job, StagePlacement{0, 1, 0, layers}, RuntimeOptions());
    if (!runtime.ok()) return Fail(runtime.status());
    StageRuntime::OuterSettings settings;
    settings.lr = absl::GetFlag(FLAGS_lr);
    settings.momentum = absl::GetFlag(FLAGS_momentum);
    if (absl::Status started = (*runtime)->StartOuter(settings); !started.ok()) {
      return Fail(started);
    }
    (*runtime)->SetDataShard(pipelines, r, /*start_step=*/0, /*base=*/0);
    runtimes.push_back(*std::move(runtime));
  }
  for (int round = 0; round < rounds; ++round) {
    std::vector<StageRuntime::OuterContribution> contributions;
    for (int r = 0; r < pipelines; ++r) {
      for (int k = 0; k < inner; ++k) {
        const int step = round * inner + k;
        for (int j = 0; j < microbatches; ++j) {
          absl::StatusOr<LinkMessage> input = runtimes[r]->LoadTrainMicrobatch(step, j);
          if (!input.ok()) return Fail(input.status());
          absl::StatusOr<LastStageResult> result = runtimes[r]->ForwardLoss(*input);
          if (!result.ok()) return Fail(result.status());
        }
        const double progress = static_cast<double>(step + 1) / job->steps();
        if (absl::Status updated = runtimes[r]->ApplyUpdate(progress); !updated.ok()) {
          return Fail(updated);
        }
      }
      absl::StatusOr<std::vector<v1::LayerWeights>> delta = runtimes[r]->ExportPseudoGradient();
      if (!delta.ok()) return Fail(delta.status());
      contributions.push_back(
          {r, static_cast<int64_t>(inner) * microbatches * job->microbatch_size(), *delta});
    }
    for (int r = 0; r < pipelines; ++r) {
      absl::StatusOr<std::vector<v1::LayerWeights>> inner = runtimes[r]->ExportWeights({});
      if (!inner.ok()) return Fail(inner.status());
      if (absl::Status written = WriteWeights(*inner, out); !written.ok()) return Fail(written);
    }
    std::cout << "round " << round + 1;
    for (int r = 0; r < pipelines; ++r) {
      if (absl::Status applied = runtimes[r]->ApplyOuterStep(contributions); !applied.ok()) {
        return Fail(applied);
      }
      std::cout << " " << runtimes[r]->WeightsDigest();
    }
    std::cout << "\n";
    absl::StatusOr<std::vector<v1::LayerWeights>> outer = runtimes[0]->ExportWeights({});
    if (!outer.ok()) return Fail(outer.status());
    if (absl::Status written = WriteWeights(*outer, out); !written.ok()) return Fail(written);
  }
  return 0;
}

}  // namespace
}  // namespace geotrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return geotrain::Run();
}
