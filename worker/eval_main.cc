// geotrain-eval: scores a Hugging Face LLaMA directory (an init_from model
// or a geotrain export) with geotrain's own model code on a token file:
// consecutive windows of context + 1 tokens from the file's start, every
// layer in this process. Prints the mean loss as one JSON line and, with
// --logits_out, writes the logits as raw little-endian float32
// [windows, context, vocab]. What the Hugging Face interop test compares
// with transformers; also a quick check of a model before fine-tuning it.
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/hf_model_dir.h"
#include "common/job_spec.h"
#include "common/model_profile.h"
#include "common/token_file.h"
#include "worker/models.h"

ABSL_FLAG(std::string, model, "", "Hugging Face LlamaForCausalLM directory (required)");
ABSL_FLAG(std::string, tokens, "", "token file (nanoGPT format) to score (required)");
ABSL_FLAG(std::string, dtype, "uint16", "token ids in --tokens: uint16 or uint32");
ABSL_FLAG(int, context, 0, "tokens per window (0: the model's max_position_embeddings)");
ABSL_FLAG(int, max_windows, 16, "windows scored, at most");
ABSL_FLAG(std::string, logits_out, "", "write the logits here (raw float32)");

namespace {

int Fail(const std::string& message) {
  std::cerr << "geotrain-eval: " << message << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "geotrain-eval --model=DIR --tokens=FILE [--context=N] [--logits_out=FILE]");
  absl::ParseCommandLine(argc, argv);
  const std::string model = absl::GetFlag(FLAGS_model), tokens = absl::GetFlag(FLAGS_tokens);
  if (model.empty() || tokens.empty()) return Fail("--model and --tokens are required");
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype != "uint16" && dtype != "uint32") return Fail("--dtype: uint16 or uint32");
  if (absl::GetFlag(FLAGS_context) < 0 || absl::GetFlag(FLAGS_max_windows) < 1) {
    return Fail("--context must be >= 0 and --max_windows >= 1");
  }
  // The job a fine-tuning run of this model would have: its architecture
  // from config.json, checked as any job is.
  const std::string text = absl::StrFormat(
      "init_from: \"%s\" llama { context: %d } tokens { train: \"%s\" validation: \"%s\" "
      "dtype: %s } steps: 1",
      absl::CHexEscape(model), absl::GetFlag(FLAGS_context), absl::CHexEscape(tokens),
      absl::CHexEscape(tokens), dtype == "uint16" ? "UINT16" : "UINT32");
  absl::StatusOr<geotrain::v1::JobSpec> job = geotrain::ParseJobSpec(text, "--model");
  if (!job.ok()) return Fail(std::string(job.status().message()));
  const int64_t context = job->llama().context();
  const int64_t vocab = job->llama().vocab();
  absl::StatusOr<geotrain::TokenFile> file = geotrain::TokenFile::Open(
      tokens, dtype == "uint16" ? 2 : 4, vocab, context + 1);
  if (!file.ok()) return Fail(std::string(file.status().message()));
  const int64_t windows =
      std::min<int64_t>(absl::GetFlag(FLAGS_max_windows), file->size() / (context + 1));
  absl::StatusOr<geotrain::HfModelDir> dir = geotrain::HfModelDir::Open(model);
  if (!dir.ok()) return Fail(std::string(dir.status().message()));

  try {
    torch::NoGradGuard no_grad;
    std::vector<int64_t> ids(static_cast<size_t>(windows * (context + 1)));
    file->Copy(0, static_cast<int64_t>(ids.size()), ids.data());
    torch::Tensor all = torch::from_blob(ids.data(), {windows, context + 1}, torch::kInt64);
    torch::Tensor x = all.slice(1, 0, context).contiguous();
    const torch::Tensor targets = all.slice(1, 1, context + 1).contiguous();
    const int layers = geotrain::NumLayers(*job);
    std::vector<std::shared_ptr<geotrain::Layer>> built = geotrain::BuildLayers(*job, 0, layers);
    for (int l = 0; l < layers; ++l) {
      absl::StatusOr<geotrain::v1::LayerCheckpoint> weights = dir->ReadLayer(*job, l);
      if (!weights.ok()) return Fail(std::string(weights.status().message()));
      std::vector<torch::Tensor> params = built[l]->parameters();
      size_t offset = 0;
      for (size_t p = 0; p < params.size(); ++p) {
        const auto n = static_cast<size_t>(params[p].numel());
        params[p].copy_(torch::from_blob(weights->mutable_payload()->data() + offset,
                                         params[p].sizes(), torch::kFloat32));
        offset += n * sizeof(float);
      }
      x = built[l]->forward(x);
    }
    const double loss = geotrain::ComputeLoss(*job, x, targets).item<double>();
    std::printf("{\"loss\": %.9g, \"windows\": %lld, \"context\": %lld, \"vocab\": %lld}\n", loss,
                static_cast<long long>(windows), static_cast<long long>(context),
                static_cast<long long>(vocab));
    if (!absl::GetFlag(FLAGS_logits_out).empty()) {
      const torch::Tensor logits = x.to(torch::kFloat32).contiguous();
      std::ofstream out(absl::GetFlag(FLAGS_logits_out), std::ios::binary | std::ios::trunc);
      out.write(static_cast<const char*>(logits.data_ptr()),
                static_cast<std::streamsize>(logits.numel() * sizeof(float)));
      if (!out) return Fail("cannot write " + absl::GetFlag(FLAGS_logits_out));
    }
  } catch (const c10::Error& e) {
    return Fail(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
  }
  return 0;
}
