// The honest spread of a spot check across BLAS kernels and LibTorch builds
// (docs/verification.md). `--emit=DIR` trains a job as a 3-stage pipeline
// for a few steps and writes, for one microbatch of its last step and for
// each of the codecs none and int8, every audit a spot check could make:
// the activations of stages 0 and 1, the gradients of stages 1 and 2, with
// the weights, digests and logged messages a verifier would get.
// `--verify=DIR` verifies each with this build (StageVerifier) and prints
// one line per audit; it exits 1 if any fails. Run the two under other
// OpenBLAS cores or from the two builds (Debian's LibTorch, the wheel's):
// the "spread" of a codec-none audit is its largest |claim - recomputed| as
// a fraction of its block's largest magnitude, against the 1e-4 that
// DeviceTolerance allows between CPUs.
//
// Usage: spot_check_spread --job=FILE (--emit=DIR | --verify=DIR)
#include <torch/version.h>

#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/codec.h"
#include "common/commitment.h"
#include "common/job_spec.h"
#include "common/status_macros.h"
#include "worker/output_check.h"
#include "worker/stage_verifier.h"

ABSL_FLAG(std::string, job, "", "job file (textproto)");
ABSL_FLAG(std::string, emit, "", "write the audits to this directory");
ABSL_FLAG(std::string, verify, "", "verify the audits in this directory");
ABSL_FLAG(int, steps, 3, "training steps before the audited one");

namespace geotrain {
namespace {

constexpr int kStages = 3;

struct Stored {
  int stage = 0;
  std::string codec;
  AuditedComputation audit;
};

void PutString(const std::string& s, std::ofstream& out) {
  const uint64_t n = s.size();
  out.write(reinterpret_cast<const char*>(&n), sizeof(n));
  out.write(s.data(), static_cast<std::streamsize>(n));
}

bool GetString(std::ifstream& in, std::string* s) {
  uint64_t n = 0;
  if (!in.read(reinterpret_cast<char*>(&n), sizeof(n)) || n > (uint64_t{1} << 32)) return false;
  s->resize(n);
  return static_cast<bool>(in.read(s->data(), static_cast<std::streamsize>(n)));
}

void PutMessage(const LinkMessage& m, std::ofstream& out) {
  PutString(m.header.SerializeAsString(), out);
  PutString(m.payload, out);
}

bool GetMessage(std::ifstream& in, LinkMessage* m) {
  std::string header;
  return GetString(in, &header) && m->header.ParseFromString(header) && GetString(in, &m->payload);
}

absl::Status Write(const std::string& path, const Stored& s) {
  std::ofstream out(path, std::ios::binary);
  PutString(std::to_string(s.stage), out);
  PutString(s.codec, out);
  PutString(std::to_string(s.audit.weights.size()), out);
  for (const v1::LayerCheckpoint& layer : s.audit.weights) PutString(layer.SerializeAsString(), out);
  PutString(s.audit.weights_digest, out);
  PutMessage(s.audit.input, out);
  PutString(s.audit.output_gradient.has_value() ? "1" : "0", out);
  if (s.audit.output_gradient.has_value()) PutMessage(*s.audit.output_gradient, out);
  PutMessage(s.audit.claim, out);
  if (!out.good()) return absl::InternalError(absl::StrCat("writing ", path));
  return absl::OkStatus();
}

absl::StatusOr<Stored> Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  Stored s;
  std::string field;
  bool ok = GetString(in, &field);
  if (ok) s.stage = std::stoi(field);
  ok = ok && GetString(in, &s.codec) && GetString(in, &field);
  const int layers = ok ? std::stoi(field) : 0;
  for (int i = 0; ok && i < layers; ++i) {
    ok = GetString(in, &field) && s.audit.weights.emplace_back().ParseFromString(field);
  }
  ok = ok && GetString(in, &s.audit.weights_digest) && GetMessage(in, &s.audit.input) &&
       GetString(in, &field);
  if (ok && field == "1") ok = GetMessage(in, &s.audit.output_gradient.emplace());
  ok = ok && GetMessage(in, &s.audit.claim);
  if (!ok) return absl::DataLossError(absl::StrCat(path, " is truncated or malformed"));
  return s;
}

LinkMessage Committed(LinkMessage m) {
  m.header.set_commitment(CommitmentOf(m.header, m.payload));
  return m;
}

// Stage k's layers: the embedding and the first half of the blocks, the
// rest of the blocks, the head.
StagePlacement PlacementOf(const v1::JobSpec& job, int stage) {
  const int blocks = job.gpt().blocks();
  const int cut = 1 + blocks / 2;
  const int begin[kStages] = {0, cut, 1 + blocks};
  const int end[kStages] = {cut, 1 + blocks, 2 + blocks};
  return {stage, kStages, begin[stage], end[stage]};
}

absl::Status Emit(const v1::JobSpec& job, const std::string& dir) {
  int written = 0;
  for (v1::Codec codec : {v1::CODEC_NONE, v1::CODEC_INT8}) {
    RuntimeOptions options;
    options.activation_encoding.codec = codec;
    options.gradient_encoding.codec = codec;
    std::unique_ptr<StageRuntime> stages[kStages];
    for (int k = 0; k < kStages; ++k) {
      ASSIGN_OR_RETURN(stages[k], StageRuntime::Create(job, PlacementOf(job, k), options));
    }
    const int steps = absl::GetFlag(FLAGS_steps);
    for (int step = 0; step <= steps; ++step) {
      for (int mb = 0; mb < job.microbatches(); ++mb) {
        ASSIGN_OR_RETURN(LinkMessage data, stages[0]->LoadTrainMicrobatch(step, mb));
        ASSIGN_OR_RETURN(LinkMessage a0, stages[0]->Forward(data));
        ASSIGN_OR_RETURN(LinkMessage a1, stages[1]->Forward(a0));
        ASSIGN_OR_RETURN(LastStageResult last, stages[2]->ForwardLoss(a1));
        ASSIGN_OR_RETURN(std::optional<LinkMessage> g1, stages[1]->Backward(*last.gradient));
        if (!g1.has_value() || !last.gradient.has_value()) return absl::InternalError("no gradient");
        RETURN_IF_ERROR(stages[0]->Backward(*g1).status());
        if (step < steps || mb > 0) continue;
        std::vector<v1::LayerCheckpoint> weights[kStages];
        for (int k = 0; k < kStages; ++k) {
          ASSIGN_OR_RETURN(weights[k], stages[k]->ExportCheckpoint(step));
        }
        const LinkMessage c_a0 = Committed(a0), c_a1 = Committed(a1);
        const LinkMessage c_g2 = Committed(*last.gradient), c_g1 = Committed(*g1);
        auto store = [&](int stage, const LinkMessage& input, std::optional<LinkMessage> gradient,
                         const LinkMessage& claim) -> absl::Status {
          Stored s;
          s.stage = stage;
          s.codec = CodecName(codec);
          s.audit.weights = weights[stage];
          s.audit.weights_digest = stages[stage]->WeightsDigest();
          s.audit.input = input;
          s.audit.output_gradient = std::move(gradient);
          s.audit.claim = claim;
          return Write(absl::StrCat(dir, "/audit-", written++, ".bin"), s);
        };
        RETURN_IF_ERROR(store(0, data, std::nullopt, c_a0));
        RETURN_IF_ERROR(store(1, c_a0, std::nullopt, c_a1));
        RETURN_IF_ERROR(store(1, c_a0, c_g2, c_g1));
        RETURN_IF_ERROR(store(2, c_a1, std::nullopt, c_g2));
      }
      for (int k = 0; k < kStages; ++k) RETURN_IF_ERROR(stages[k]->ApplyUpdate(0.5));
    }
  }
  std::cout << "emitted " << written << " audits with LibTorch " << TORCH_VERSION << "\n";
  return absl::OkStatus();
}

absl::StatusOr<bool> VerifyAll(const v1::JobSpec& job, const std::string& dir) {
  bool all_passed = true;
  double worst_spread = 0;
  for (int i = 0;; ++i) {
    const std::string path = absl::StrCat(dir, "/audit-", i, ".bin");
    if (!std::ifstream(path).good()) {
      if (i == 0) return absl::NotFoundError(absl::StrCat("no audits in ", dir));
      break;
    }
    ASSIGN_OR_RETURN(Stored s, Read(path));
    ASSIGN_OR_RETURN(std::unique_ptr<StageVerifier> verifier,
                     StageVerifier::Create(job, PlacementOf(job, s.stage)));
    ASSIGN_OR_RETURN(OutputComparison result, verifier->Verify(s.audit));
    const char* kind =
        s.audit.claim.header.kind() == v1::MESSAGE_KIND_ACTIVATION ? "activation" : "gradient";
    std::string spread;
    if (s.codec == "none") {
      const double value = result.worst_ratio * DeviceTolerance("cpu", "cpu");
      worst_spread = std::max(worst_spread, value);
      spread = absl::StrFormat(", spread %.3g of the block's absmax", value);
    }
    std::cout << "stage " << s.stage << " " << kind << " (" << s.codec
              << "): " << result.Summary() << spread << "\n";
    all_passed = all_passed && result.passed;
  }
  std::cout << "verified with LibTorch " << TORCH_VERSION << ": "
            << (all_passed ? "all passed" : "SOME FAILED")
            << absl::StrFormat(", worst codec-none spread %.3g (tolerance 1e-4)", worst_spread)
            << "\n";
  return all_passed;
}

int Run() {
  absl::StatusOr<v1::JobSpec> job = LoadJobSpec(absl::GetFlag(FLAGS_job));
  if (!job.ok()) {
    std::cerr << "spot_check_spread: " << job.status() << "\n";
    return 2;
  }
  if (!absl::GetFlag(FLAGS_emit).empty()) {
    absl::Status emitted = Emit(*job, absl::GetFlag(FLAGS_emit));
    if (!emitted.ok()) std::cerr << "spot_check_spread: " << emitted << "\n";
    return emitted.ok() ? 0 : 2;
  }
  if (absl::GetFlag(FLAGS_verify).empty()) {
    std::cerr << "spot_check_spread: give --emit=DIR or --verify=DIR\n";
    return 2;
  }
  absl::StatusOr<bool> passed = VerifyAll(*job, absl::GetFlag(FLAGS_verify));
  if (!passed.ok()) {
    std::cerr << "spot_check_spread: " << passed.status() << "\n";
    return 2;
  }
  return *passed ? 0 : 1;
}

}  // namespace
}  // namespace geotrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return geotrain::Run();
}
