// The honest spread of a spot check across BLAS kernels and LibTorch builds
// (docs/verification.md). `--emit=DIR` trains a job as a 3-stage pipeline
// for a few steps and writes, for one microbatch of its last step and for
// each of the codecs none and int8, every audit a spot check could make:
// the activations of stages 0 and 1, the gradients of stages 1 and 2, with
// the weights, digests and logged messages a verifier would get; and each
// stage's update of that step (an update audit).
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

struct StoredUpdate {
  int stage = 0;
  AuditedUpdate audit;
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
  ok = ok && GetMessage(in, &s.audit.input) && GetString(in, &field);
  if (ok && field == "1") ok = GetMessage(in, &s.audit.output_gradient.emplace());
  ok = ok && GetMessage(in, &s.audit.claim);
  if (!ok) return absl::DataLossError(absl::StrCat(path, " is truncated or malformed"));
  return s;
}

void PutLayers(const std::vector<v1::LayerCheckpoint>& layers, std::ofstream& out) {
  PutString(std::to_string(layers.size()), out);
  for (const v1::LayerCheckpoint& layer : layers) PutString(layer.SerializeAsString(), out);
}

bool GetLayers(std::ifstream& in, std::vector<v1::LayerCheckpoint>* layers) {
  std::string field;
  if (!GetString(in, &field)) return false;
  const int count = std::stoi(field);
  for (int i = 0; i < count; ++i) {
    if (!GetString(in, &field) || !layers->emplace_back().ParseFromString(field)) return false;
  }
  return true;
}

absl::Status WriteUpdate(const std::string& path, const StoredUpdate& s) {
  std::ofstream out(path, std::ios::binary);
  PutString(std::to_string(s.stage), out);
  PutLayers(s.audit.before, out);
  PutString(s.audit.before_digest, out);
  PutString(std::to_string(s.audit.microbatches.size()), out);
  for (const AuditedUpdate::Microbatch& m : s.audit.microbatches) {
    PutMessage(m.input, out);
    PutString(m.output_gradient.has_value() ? "1" : "0", out);
    if (m.output_gradient.has_value()) PutMessage(*m.output_gradient, out);
  }
  PutString(absl::StrFormat("%.17g", s.audit.progress), out);
  PutLayers(s.audit.after, out);
  PutString(s.audit.after_digest, out);
  if (!out.good()) return absl::InternalError(absl::StrCat("writing ", path));
  return absl::OkStatus();
}

absl::StatusOr<StoredUpdate> ReadUpdate(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  StoredUpdate s;
  std::string field;
  bool ok = GetString(in, &field);
  if (ok) s.stage = std::stoi(field);
  ok = ok && GetLayers(in, &s.audit.before) && GetString(in, &s.audit.before_digest) &&
       GetString(in, &field);
  const int count = ok ? std::stoi(field) : 0;
  for (int i = 0; ok && i < count; ++i) {
    AuditedUpdate::Microbatch& m = s.audit.microbatches.emplace_back();
    ok = GetMessage(in, &m.input) && GetString(in, &field);
    if (ok && field == "1") ok = GetMessage(in, &m.output_gradient.emplace());
  }
  ok = ok && GetString(in, &field);
  if (ok) s.audit.progress = std::stod(field);
  ok = ok && GetLayers(in, &s.audit.after) && GetString(in, &s.audit.after_digest);
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
    StoredUpdate updates[kStages];
    for (int step = 0; step <= steps; ++step) {
      for (int mb = 0; mb < job.microbatches(); ++mb) {
        ASSIGN_OR_RETURN(LinkMessage data, stages[0]->LoadTrainMicrobatch(step, mb));
        ASSIGN_OR_RETURN(LinkMessage a0, stages[0]->Forward(data));
        ASSIGN_OR_RETURN(LinkMessage a1, stages[1]->Forward(a0));
        ASSIGN_OR_RETURN(LastStageResult last, stages[2]->ForwardLoss(a1));
        ASSIGN_OR_RETURN(std::optional<LinkMessage> g1, stages[1]->Backward(*last.gradient));
        if (!g1.has_value() || !last.gradient.has_value()) return absl::InternalError("no gradient");
        RETURN_IF_ERROR(stages[0]->Backward(*g1).status());
        if (step < steps) continue;
        if (codec == v1::CODEC_NONE) {  // update audits once: the codec is the links'
          for (int k = 0; k < kStages; ++k) {
            AuditedUpdate::Microbatch& m = updates[k].audit.microbatches.emplace_back();
            m.input = k == 0 ? data : Committed(k == 1 ? a0 : a1);
            if (k < 2) m.output_gradient = Committed(k == 0 ? *g1 : *last.gradient);
          }
        }
        if (mb > 0) continue;
        std::vector<v1::LayerCheckpoint> weights[kStages];
        std::string digest[kStages];
        for (int k = 0; k < kStages; ++k) {
          ASSIGN_OR_RETURN(weights[k], stages[k]->ExportCheckpoint(step));
          digest[k] = stages[k]->WeightsDigest();
          updates[k].stage = k;
          updates[k].audit.before = weights[k];
          updates[k].audit.before_digest = digest[k];
        }
        // Each output commits to its stage's weights, as a worker's do in
        // a job with spot checks.
        auto committed = [&](LinkMessage m, int stage) {
          m.header.set_weights_digest(digest[stage]);
          return Committed(std::move(m));
        };
        const LinkMessage c_a0 = committed(a0, 0), c_a1 = committed(a1, 1);
        const LinkMessage c_g2 = committed(*last.gradient, 2), c_g1 = committed(*g1, 1);
        auto store = [&](int stage, const LinkMessage& input, std::optional<LinkMessage> gradient,
                         const LinkMessage& claim) -> absl::Status {
          Stored s;
          s.stage = stage;
          s.codec = CodecName(codec);
          s.audit.weights = weights[stage];
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
    for (int k = 0; codec == v1::CODEC_NONE && k < kStages; ++k) {
      updates[k].audit.progress = 0.5;
      ASSIGN_OR_RETURN(updates[k].audit.after, stages[k]->ExportCheckpoint(steps + 1));
      updates[k].audit.after_digest = stages[k]->WeightsDigest();
      RETURN_IF_ERROR(WriteUpdate(absl::StrCat(dir, "/update-", k, ".bin"), updates[k]));
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
  for (int k = 0;; ++k) {
    const std::string path = absl::StrCat(dir, "/update-", k, ".bin");
    if (!std::ifstream(path).good()) break;
    ASSIGN_OR_RETURN(StoredUpdate s, ReadUpdate(path));
    ASSIGN_OR_RETURN(std::unique_ptr<StageVerifier> verifier,
                     StageVerifier::Create(job, PlacementOf(job, s.stage)));
    ASSIGN_OR_RETURN(OutputComparison result, verifier->VerifyUpdate(s.audit));
    std::cout << "stage " << s.stage << " update of " << s.audit.microbatches.size()
              << " microbatches: " << result.Summary() << "\n";
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
