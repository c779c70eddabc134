#include "common/job_spec.h"

#include "common/hf_llama.h"

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/link_message.h"
#include "common/model_profile.h"

namespace geotrain {
namespace {

// Collects textproto parse errors as "line:col: message".
class ErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    errors_.push_back(absl::StrCat(line + 1, ":", column + 1, ": ", message));
  }
  void AddWarning(int line, int column, const std::string& message) override {
    AddError(line, column, message);
  }
  std::string Joined() const { return absl::StrJoin(errors_, "; "); }

 private:
  std::vector<std::string> errors_;
};

// Bounds on what a job file may ask for: far above any model trained
// here, far below what would exhaust a machine before anything is checked.
constexpr uint64_t kMaxJobFileBytes = 1 << 20;
constexpr int kMaxContext = 1 << 16;
constexpr int kMaxWidth = 1 << 16;
constexpr int kMaxBlocks = 1024;
constexpr int kMaxVocab = 1 << 20;
constexpr int kMaxSteps = 100000000;
constexpr int kMaxEvalBatches = 100000;

absl::Status Invalid(const std::string& what) {
  return absl::InvalidArgumentError(what);
}

}  // namespace

void ApplyJobDefaults(v1::JobSpec* job) {
  if (job->name().empty()) job->set_name("job");
  if (job->schedule() == v1::SCHEDULE_UNSPECIFIED) {
    job->set_schedule(v1::SCHEDULE_SYNC);
  }
  if (job->microbatches() == 0) job->set_microbatches(4);
  if (job->microbatch_size() == 0) job->set_microbatch_size(16);
  if (job->min_workers() == 0) job->set_min_workers(1);
  if (job->eval_batches() == 0) job->set_eval_batches(8);
  if (job->lease_ms() == 0) job->set_lease_ms(5000);
  if (job->checkpoint_every() == 0) job->set_checkpoint_every(10);
  // `verification {}` asks for spot checks at the default rate.
  if (job->has_verification() && !job->verification().has_fraction()) {
    job->mutable_verification()->set_fraction(0.01);
  }
  if (job->update_every() == 0) job->set_update_every(1);
  if (job->activation_codec() == v1::CODEC_UNSPECIFIED) job->set_activation_codec(v1::CODEC_NONE);
  if (job->gradient_codec() == v1::CODEC_UNSPECIFIED) job->set_gradient_codec(v1::CODEC_NONE);
  if (job->codec_block_size() == 0) job->set_codec_block_size(64);
  if (job->replicas() == 0) job->set_replicas(1);
  if (job->replica_sync_every() == 0) job->set_replica_sync_every(5);
  if (job->replica_codec() == v1::CODEC_UNSPECIFIED) job->set_replica_codec(v1::CODEC_FP16);
  if (job->topk_fraction() == 0) job->set_topk_fraction(0.01);
  if (job->has_outer()) {
    v1::OuterOptimizer* outer = job->mutable_outer();
    if (outer->inner_steps() == 0) outer->set_inner_steps(50);
    if (outer->lr() == 0) outer->set_lr(0.7);
    if (!outer->has_momentum()) outer->set_momentum(0.9);
    if (outer->codec() == v1::CODEC_UNSPECIFIED) outer->set_codec(v1::CODEC_INT8);
  }
  v1::Optimizer* opt = job->mutable_optimizer();
  if (opt->kind() == v1::Optimizer::KIND_UNSPECIFIED) {
    opt->set_kind(v1::Optimizer::KIND_ADAMW);
  }
  if (opt->lr() == 0) opt->set_lr(1e-3);
  if (opt->beta1() == 0) opt->set_beta1(0.9);
  if (opt->beta2() == 0) opt->set_beta2(0.999);
  if (job->has_gpt()) {
    v1::GptModel* gpt = job->mutable_gpt();
    if (gpt->mlp_ratio() == 0) gpt->set_mlp_ratio(4);
  }
  if (job->has_llama()) {
    v1::LlamaModel* llama = job->mutable_llama();
    if (llama->kv_heads() == 0) llama->set_kv_heads(llama->heads());
    if (llama->vocab() == 0) llama->set_vocab(256);
    if (llama->rope_theta() == 0) llama->set_rope_theta(10000);
    if (llama->rms_norm_eps() == 0) llama->set_rms_norm_eps(1e-6);
    if (llama->intermediate() == 0 && llama->d_model() > 0 && llama->d_model() <= kMaxWidth) {
      // LLaMA's 2/3 of 4 d_model, rounded up to a multiple of 64.
      const int64_t hidden = (int64_t{8} * llama->d_model() + 2) / 3;
      llama->set_intermediate(static_cast<int>((hidden + 63) / 64 * 64));
    }
  }
  if (job->has_tokens() && job->tokens().dtype() == v1::TokenData::TOKEN_DTYPE_UNSPECIFIED) {
    job->mutable_tokens()->set_dtype(v1::TokenData::UINT16);
  }
  if (job->has_text()) {
    v1::TextData* text = job->mutable_text();
    if (text->paths().empty()) text->add_paths("/usr/share/games/fortunes");
    if (text->validation_fraction() == 0) text->set_validation_fraction(0.05);
  }
  if (job->has_fashion_mnist() && job->fashion_mnist().dir().empty()) {
    job->mutable_fashion_mnist()->set_dir("/usr/share/datasets/fashion-mnist");
  }
}

absl::Status ValidateJobSpec(const v1::JobSpec& job) {
  if (job.model_case() == v1::JobSpec::MODEL_NOT_SET) {
    return Invalid("no model: set `gpt { ... }`, `llama { ... }` or `mlp { ... }`");
  }
  if (job.data_case() == v1::JobSpec::DATA_NOT_SET) {
    return Invalid("no data: set `text { ... }`, `tokens { ... }` or `fashion_mnist { ... }`");
  }
  if (job.has_gpt()) {
    const v1::GptModel& gpt = job.gpt();
    if (gpt.context() <= 0 || gpt.d_model() <= 0 || gpt.heads() <= 0 ||
        gpt.blocks() <= 0) {
      return Invalid(
          "gpt: context, d_model, heads and blocks must all be positive");
    }
    if (gpt.d_model() % gpt.heads() != 0) {
      return Invalid(absl::StrCat("gpt: d_model (", gpt.d_model(),
                                  ") must be a multiple of heads (",
                                  gpt.heads(), ")"));
    }
    if (gpt.mlp_ratio() <= 0) return Invalid("gpt: mlp_ratio must be > 0");
    if (gpt.context() > kMaxContext || gpt.d_model() > kMaxWidth || gpt.heads() > 1024 ||
        gpt.blocks() > kMaxBlocks || gpt.mlp_ratio() > 64) {
      return Invalid(absl::StrCat("gpt: context at most ", kMaxContext, ", d_model at most ",
                                  kMaxWidth, ", heads at most 1024, blocks at most ", kMaxBlocks,
                                  ", mlp_ratio at most 64"));
    }
    if (!job.has_text() && !job.has_tokens()) {
      return Invalid("a gpt model trains on `text` or `tokens` data");
    }
  }
  if (job.has_llama()) {
    const v1::LlamaModel& m = job.llama();
    if (m.context() <= 0 || m.d_model() <= 0 || m.heads() <= 0 || m.blocks() <= 0 ||
        m.kv_heads() <= 0 || m.intermediate() <= 0 || m.vocab() <= 1) {
      return Invalid(
          "llama: context, d_model, heads, kv_heads, blocks and intermediate must be positive, "
          "vocab at least 2");
    }
    if (m.context() > kMaxContext || m.d_model() > kMaxWidth || m.heads() > 1024 ||
        m.blocks() > kMaxBlocks || m.intermediate() > 4 * kMaxWidth || m.vocab() > kMaxVocab) {
      return Invalid(absl::StrCat("llama: context at most ", kMaxContext, ", d_model at most ",
                                  kMaxWidth, ", heads at most 1024, blocks at most ", kMaxBlocks,
                                  ", intermediate at most ", 4 * kMaxWidth, ", vocab at most ",
                                  kMaxVocab));
    }
    if (m.d_model() % m.heads() != 0 || (m.d_model() / m.heads()) % 2 != 0) {
      return Invalid(absl::StrCat("llama: d_model (", m.d_model(), ") / heads (", m.heads(),
                                  ") must be a whole, even head size (rotary positions "
                                  "rotate pairs)"));
    }
    if (m.heads() % m.kv_heads() != 0) {
      return Invalid(absl::StrCat("llama: kv_heads (", m.kv_heads(), ") must divide heads (",
                                  m.heads(), ")"));
    }
    if (!(m.rope_theta() > 1) || !(m.rms_norm_eps() > 0 && m.rms_norm_eps() < 1)) {
      return Invalid("llama: rope_theta must be > 1 and rms_norm_eps in (0, 1)");
    }
    if (m.tie_embeddings() && job.schedule() != v1::SCHEDULE_SYNC) {
      // The first and the last stage trade the tied matrix's gradient at
      // each update; only a flushed step has nothing in flight between them
      // then, so neither waits on pipeline work the other holds.
      return Invalid(absl::StrCat(
          "llama: tie_embeddings needs schedule SCHEDULE_SYNC (the schedule is ",
          ScheduleName(job.schedule()),
          "): the embedding's stage and the head's exchange gradients at every update"));
    }
    if (!job.has_text() && !job.has_tokens()) {
      return Invalid("a llama model trains on `text` or `tokens` data");
    }
    if (job.has_text() && m.vocab() < 256) {
      return Invalid(absl::StrCat("llama: `text` data is bytes, so vocab must be at least 256 "
                                  "(it is ", m.vocab(), ")"));
    }
  }
  if (job.has_tokens()) {
    const v1::TokenData& tokens = job.tokens();
    if (tokens.train().empty() || tokens.validation().empty()) {
      return Invalid("tokens: set `train` and `validation` (token files)");
    }
    if (tokens.train().size() > 4096 || tokens.validation().size() > 4096) {
      return Invalid("tokens: paths at most 4096 bytes");
    }
    if (!v1::TokenData::TokenDType_IsValid(tokens.dtype())) {
      return Invalid("tokens: dtype is UINT16 or UINT32");
    }
    if (!job.has_gpt() && !job.has_llama()) {
      return Invalid("`tokens` data is for a gpt or llama model");
    }
  }
  if (job.has_mlp()) {
    for (int width : job.mlp().hidden()) {
      if (width <= 0) return Invalid("mlp: every hidden width must be > 0");
      if (width > kMaxWidth) return Invalid(absl::StrCat("mlp: hidden widths at most ", kMaxWidth));
    }
    if (job.mlp().hidden_size() > kMaxBlocks) {
      return Invalid(absl::StrCat("mlp: at most ", kMaxBlocks, " hidden layers"));
    }
    if (!job.has_fashion_mnist()) {
      return Invalid("an mlp model trains on `fashion_mnist` data");
    }
  }
  if (job.has_text()) {
    const double f = job.text().validation_fraction();
    if (f <= 0 || f >= 0.5) {
      return Invalid("text: validation_fraction must be in (0, 0.5)");
    }
  }
  if (job.name().size() > 128) return Invalid("name: at most 128 bytes");
  if (job.steps() <= 0) return Invalid("steps must be > 0");
  if (job.steps() > kMaxSteps) return Invalid(absl::StrCat("steps at most ", kMaxSteps));
  if (job.microbatches() > 4096) return Invalid("microbatches at most 4096");
  if (job.microbatch_size() > (1 << 20)) return Invalid("microbatch_size at most 2^20");
  if (job.min_workers() > 10000) return Invalid("min_workers at most 10000");
  if (job.max_stages() > 4096) return Invalid("max_stages at most 4096");
  if (job.eval_batches() > kMaxEvalBatches) {
    return Invalid(absl::StrCat("eval_batches at most ", kMaxEvalBatches));
  }
  if (job.lease_ms() > 3600 * 1000) return Invalid("lease_ms at most one hour");
  if (!(job.verification().fraction() >= 0 && job.verification().fraction() <= 1)) {
    return Invalid("verification.fraction must be in [0, 1]");
  }
  if (job.checkpoint_every() > kMaxSteps) return Invalid("checkpoint_every at most steps' bound");
  if (job.replica_sync_every() > kMaxSteps) return Invalid("replica_sync_every out of range");
  if (job.codec_block_size() < 0 || job.codec_block_size() > (1 << 20)) {
    return Invalid("codec_block_size at most 2^20");
  }
  if (job.microbatches() <= 0) return Invalid("microbatches must be > 0");
  if (job.microbatch_size() <= 0) return Invalid("microbatch_size must be > 0");
  if (job.min_workers() <= 0) return Invalid("min_workers must be > 0");
  if (job.max_stages() < 0) return Invalid("max_stages must be >= 0");
  if (job.eval_every() < 0) return Invalid("eval_every must be >= 0");
  if (job.eval_batches() < 0) return Invalid("eval_batches must be >= 0");
  if (job.lease_ms() < 200) return Invalid("lease_ms must be >= 200");
  if (job.schedule() != v1::SCHEDULE_SYNC && job.schedule() != v1::SCHEDULE_ASYNC_STASH &&
      job.schedule() != v1::SCHEDULE_ASYNC_2BW) {
    return Invalid(absl::StrCat("unknown schedule ", ScheduleName(job.schedule())));
  }
  // Every message of the window must fit a worker's inbox (64) with room for
  // control messages; beyond that the queues could fill in a cycle.
  if (job.adaptive() && job.activation_codec() == v1::CODEC_NONE &&
      job.gradient_codec() == v1::CODEC_NONE) {
    return Invalid(
        "adaptive compression needs a strongest codec to step up to: set activation_codec "
        "and/or gradient_codec (e.g. CODEC_INT4)");
  }
  if (job.replicas() < 1 || job.replicas() > 8) return Invalid("replicas must be in [1, 8]");
  if (job.replicas() > 1 && job.schedule() != v1::SCHEDULE_ASYNC_STASH) {
    // sync promises one-process maths, which replicas updating on their own
    // microbatches break; 2BW's two-version bound assumes gradients return
    // in order, which routing past a slow replica does not keep.
    return Invalid(
        "replicas > 1 needs the asynchronous schedule SCHEDULE_ASYNC_STASH: replicas update "
        "on their own microbatches (not sync's one-process maths) and return them out of "
        "order (beyond 2BW's two weight versions)");
  }
  if (job.replica_sync_every() < 1) return Invalid("replica_sync_every must be >= 1");
  if (job.has_outer()) {
    const v1::OuterOptimizer& outer = job.outer();
    if (outer.inner_steps() < 1 || outer.inner_steps() > kMaxSteps) {
      return Invalid("outer.inner_steps must be >= 1");
    }
    if (!(outer.lr() > 0 && outer.lr() <= 10)) return Invalid("outer.lr must be in (0, 10]");
    if (!(outer.momentum() >= 0 && outer.momentum() < 1)) {
      return Invalid("outer.momentum must be in [0, 1)");
    }
    if (outer.codec() == v1::CODEC_TOPK) {
      return Invalid("outer.codec CODEC_TOPK: use NONE, FP16, BF16, INT8 or INT4 (with error "
                     "feedback)");
    }
    if (outer.max_pipelines() < 0 || outer.max_pipelines() > 256) {
      return Invalid("outer.max_pipelines must be in [0, 256]");
    }
    if (outer.split_batch() && outer.max_pipelines() > job.microbatches()) {
      return Invalid(absl::StrCat("outer.split_batch with max_pipelines ", outer.max_pipelines(),
                                  " > microbatches ", job.microbatches(),
                                  ": each pipeline runs at least one microbatch of a step"));
    }
    if (outer.split_batch() && job.schedule() == v1::SCHEDULE_ASYNC_STASH &&
        job.update_every() > 1) {
      return Invalid("outer.split_batch with update_every > 1: a pipeline's share of a step "
                     "need not be a multiple of it (leave update_every at 1)");
    }
    if (job.replicas() > 1) {
      return Invalid("outer and replicas > 1 do not mix: with pipelines, a stage's replicas are "
                     "the same stage in the other pipelines (drop replicas)");
    }
    if (job.llama().tie_embeddings()) {
      return Invalid("outer with llama.tie_embeddings is not supported yet");
    }
  }
  if (job.replica_codec() == v1::CODEC_TOPK) {
    return Invalid("replica_codec CODEC_TOPK would drop most of the weights; use NONE, FP16, "
                   "BF16, INT8 or INT4");
  }
  for (v1::Codec codec : {job.activation_codec(), job.gradient_codec(), job.replica_codec(),
                          job.has_outer() ? job.outer().codec() : v1::CODEC_NONE}) {
    bool exact;
    if (!EncodedSizeBound(codec, 1, job.codec_block_size(), &exact).ok()) {
      return Invalid(absl::StrCat("unknown codec ", static_cast<int>(codec),
                                  " or codec_block_size ", job.codec_block_size()));
    }
  }
  if (!(job.topk_fraction() > 0 && job.topk_fraction() <= 1)) {
    return Invalid("topk_fraction must be in (0, 1]");
  }
  if (job.in_flight() < 0 || job.in_flight() > 32) {
    return Invalid("in_flight must be in [0, 32]");
  }
  if (job.update_every() <= 0) return Invalid("update_every must be > 0");
  if (job.microbatches() % job.update_every() != 0) {
    return Invalid(absl::StrCat("update_every (", job.update_every(),
                                ") must divide microbatches (", job.microbatches(), ")"));
  }
  const v1::Optimizer& opt = job.optimizer();
  if (opt.lr() <= 0) return Invalid("optimizer.lr must be > 0");
  if (opt.weight_decay() < 0) return Invalid("optimizer.weight_decay < 0");
  if (opt.warmup_fraction() < 0 || opt.warmup_fraction() >= 1) {
    return Invalid("optimizer.warmup_fraction must be in [0, 1)");
  }
  if (opt.min_lr_fraction() < 0 || opt.min_lr_fraction() > 1) {
    return Invalid("optimizer.min_lr_fraction must be in [0, 1]");
  }
  if (opt.beta1() <= 0 || opt.beta1() >= 1 || opt.beta2() <= 0 ||
      opt.beta2() >= 1) {
    return Invalid("optimizer betas must be in (0, 1)");
  }
  // Last, once every count above is known to be positive and bounded (the
  // profile below multiplies them; a negative count was undefined behaviour
  // here, found by job_spec_fuzz): the biggest tensor that crosses a
  // boundary must fit one link message, and a layer's parameters must be
  // countable. Products in 64 bits.
  const int64_t batch = job.microbatch_size();
  int64_t widest = 0;
  if (job.has_gpt()) {
    widest = int64_t{job.gpt().context()} *
             std::max<int64_t>(int64_t{job.gpt().d_model()} * job.gpt().mlp_ratio(), 256);
  } else if (job.has_llama()) {
    widest = int64_t{job.llama().context()} *
             std::max<int64_t>(job.llama().intermediate(), job.llama().vocab());
  } else if (job.has_mlp()) {
    widest = 784;
    for (int width : job.mlp().hidden()) widest = std::max<int64_t>(widest, width);
  }
  if (batch * widest * 4 > int64_t{1} << 30) {
    return Invalid(absl::StrCat(
        "microbatch_size ", batch, " x the widest activation (", widest,
        " values) is over 1 GiB: no link message may carry it; use smaller microbatches"));
  }
  int64_t largest_layer = 0;
  for (const LayerProfile& layer : ProfileLayers(job)) {
    largest_layer = std::max<int64_t>(largest_layer, layer.parameter_count);
  }
  if (largest_layer > int64_t{1} << 32) {
    return Invalid(absl::StrCat("a layer of ", largest_layer, " parameters: at most 2^32"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text,
                                         const std::string& source) {
  v1::JobSpec job;
  google::protobuf::TextFormat::Parser parser;
  ErrorCollector errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &job)) {
    return Invalid(absl::StrCat(source, ": ", errors.Joined()));
  }
  if (!job.init_from().empty()) {
    if (job.has_gpt() || job.has_mlp()) {
      return Invalid(absl::StrCat(source, ": init_from needs a llama {} model (a Hugging Face "
                                  "LlamaForCausalLM directory)"));
    }
    // The directory's config.json decides the architecture; what the job's
    // block sets (as written, before defaults) must agree with it.
    const std::string config_path = job.init_from() + "/config.json";
    absl::StatusOr<std::string> config_text = ReadFileBounded(config_path, 1 << 20);
    if (!config_text.ok()) {
      return Invalid(absl::StrCat(source, ": init_from: ", config_text.status().message()));
    }
    absl::StatusOr<v1::LlamaModel> config = LlamaFromConfigJson(*config_text, config_path);
    if (!config.ok()) return Invalid(absl::StrCat(source, ": ", config.status().message()));
    if (absl::Status agrees = CheckLlamaAgainstConfig(job.llama(), *config, config_path);
        !agrees.ok()) {
      return Invalid(absl::StrCat(source, ": ", agrees.message()));
    }
    const int context = job.llama().context();
    *job.mutable_llama() = *config;
    if (context > 0) job.mutable_llama()->set_context(context);
  }
  ApplyJobDefaults(&job);
  absl::Status valid = ValidateJobSpec(job);
  if (!valid.ok()) {
    return Invalid(absl::StrCat(source, ": ", valid.message()));
  }
  return job;
}

absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileBounded(path, kMaxJobFileBytes);
  if (!text.ok()) return text.status();
  return ParseJobSpec(*text, path);
}

std::string ScheduleName(v1::Schedule schedule) {
  switch (schedule) {
    case v1::SCHEDULE_SYNC:
      return "sync";
    case v1::SCHEDULE_ASYNC_STASH:
      return "async-stash";
    case v1::SCHEDULE_ASYNC_2BW:
      return "async-2bw";
    default:
      return absl::StrCat("schedule#", static_cast<int>(schedule));
  }
}

absl::StatusOr<v1::Schedule> ParseSchedule(const std::string& name) {
  if (name == "sync") return v1::SCHEDULE_SYNC;
  if (name == "async-stash") return v1::SCHEDULE_ASYNC_STASH;
  if (name == "async-2bw") return v1::SCHEDULE_ASYNC_2BW;
  return Invalid(absl::StrCat("unknown schedule '", name,
                              "' (known: sync, async-stash, async-2bw)"));
}

int PipelineCap(const v1::JobSpec& job) {
  if (!job.has_outer()) return 1;
  int cap = job.outer().max_pipelines();
  if (job.outer().split_batch()) {
    const int m = std::max(1, job.microbatches());
    cap = cap > 0 ? std::min(cap, m) : m;
  }
  return cap;
}

}  // namespace geotrain
