#include "worker/stage_runtime.h"

#include <openssl/evp.h>
#include <torch/torch.h>

#include <map>
#include <optional>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/model_profile.h"
#include "common/status_macros.h"
#include "common/tensor_wire.h"
#include "common/layer_state.h"
#include "common/logging.h"
#include "worker/datasets.h"
#include "worker/models.h"
#include "worker/optimizer.h"
#include "worker/outer_optimizer.h"
#include "worker/weight_stash.h"

namespace geotrain {

struct StageRuntime::Impl {
  v1::JobSpec job;
  StagePlacement placement;
  RuntimeOptions options;
  torch::Device device{torch::kCPU};
  std::vector<std::shared_ptr<Layer>> layers;
  std::vector<size_t> layer_offsets;  // first parameter of each layer

  // Parameters [first, second) of the stage's layer `i` (0-based), out of
  // `count` in all.
  std::pair<size_t, size_t> LayerParams(size_t i, size_t count) const {
    return {layer_offsets[i], i + 1 < layers.size() ? layer_offsets[i + 1] : count};
  }
  std::unique_ptr<WeightStash> stash;
  std::unique_ptr<OutOfPlaceOptimizer> optimizer;
  // Weight versions published by anything but an optimizer update (a
  // restore, replica averaging, an outer step): LinkHeader.weight_syncs.
  int64_t weight_syncs = 0;
  // Publishes `weights` as a version that is not an update of this stage.
  void PublishSync(std::vector<torch::Tensor> weights) {
    stash->Publish(std::move(weights));
    ++weight_syncs;
  }
  // With pipelines: the outer step, its encoder, and the weights the last
  // pseudo-gradient was taken from.
  std::unique_ptr<OuterOptimizer> outer;
  std::unique_ptr<ErrorFeedbackEncoder> outer_encoder;
  std::unique_ptr<ErrorFeedbackEncoder> mean_encoder;  // the reducer's means
  std::vector<torch::Tensor> outer_sent_from;
  // The outer state a checkpoint held (RestoreCheckpoint), for StartOuter:
  // per parameter (undefined where none was restored).
  struct RestoredOuter {
    std::vector<torch::Tensor> weights, momentum;
    int64_t rounds = 0;
  };
  std::optional<RestoredOuter> restored_outer;
  std::unique_ptr<Dataset> dataset;  // stage 0 only
  // SetDataShard's figures.
  int shard_pipelines = 1, shard_pipeline = 0, shard_start_step = 0;
  int64_t shard_base = 0;
  int shard_microbatches = 1;  // m: this pipeline's microbatches a step
  int64_t shard_block = 1;     // the indices a step spans
  // The training microbatches drawn since SetDataShard (-1: none).
  int64_t drawn_first = -1, drawn_last = -1;
  // Flags of tensors decoded on the GPU, read after the next
  // synchronisation (the outgoing message's copy to the host, the loss).
  DeferredDeviceChecks device_checks;
  std::vector<torch::Tensor> gradient_sum;
  int64_t gradient_count = 0;
  // Tied embeddings: the stage's parameter index of the embedding's matrix
  // (first stage) and of the head's (last stage), where it holds them.
  std::optional<size_t> tied_embedding, tied_head;

  struct Pending {
    torch::Tensor input;   // requires grad on stages > 0
    torch::Tensor output;  // graph root
    int64_t version = 0;   // weight version the forward used
    int64_t weight_counter_sum = 0;  // in-place modification counters then
  };
  std::map<uint64_t, Pending> pending;
  int64_t staleness_max = 0;
  int64_t staleness_sum = 0;
  int64_t backwards_checked = 0;

  // Sums stay on the device until the pass is taken: evaluation adds no
  // synchronisation per microbatch.
  struct EvalPass {
    torch::Tensor loss_sum;  // double, on the device
    int64_t elements = 0;
    torch::Tensor correct;   // int64, on the device; undefined unless a classifier
    int64_t samples = 0;
  };
  std::map<int, EvalPass> evals;  // by evaluation step

  void DropGradients() {
    gradient_sum.clear();
    gradient_count = 0;
  }

  bool is_first() const { return placement.stage == 0; }
  bool is_last() const { return placement.stage == placement.num_stages - 1; }

  // What evaluations run on: with the outer optimizer, the outer weights
  // (the model as of the last outer step, the same on every replica of the
  // stage), copied to the device once per outer step; else the current
  // weights.
  const std::vector<torch::Tensor>& EvalParams() {
    if (outer == nullptr) return stash->Get(stash->current_version());
    if (eval_params_round != outer->rounds() || eval_params.empty()) {
      eval_params.clear();
      const std::vector<torch::Tensor>& current = stash->Get(stash->current_version());
      for (size_t p = 0; p < current.size(); ++p) {
        eval_params.push_back(outer->outer_weights()[p].to(current[p].device()));
      }
      eval_params_round = outer->rounds();
    }
    return eval_params;
  }
  std::vector<torch::Tensor> eval_params;
  int64_t eval_params_round = -1;
  int64_t forwards_run = 0;  // RunLayers calls (RuntimeOptions::tamper_*)
  int64_t updates_run = 0;   // ApplyUpdate calls with gradients (the same)

  torch::Tensor RunLayers(torch::Tensor x, const std::vector<torch::Tensor>& params) {
    const bool skip = options.tamper_skip_layer >= 0 &&
                      forwards_run++ >= options.tamper_after_forwards;
    if (skip && forwards_run == options.tamper_after_forwards + 1) {
      GT_LOG(Warning) << "tampering: leaving out layer "
                      << placement.layer_begin + options.tamper_skip_layer
                      << " from forward pass " << forwards_run;
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      if (skip && static_cast<int>(i) == options.tamper_skip_layer) continue;
      const auto [begin, end] = LayerParams(static_cast<size_t>(i), params.size());
      x = layers[i]->Forward(x, at::ArrayRef<torch::Tensor>(params.data() + begin, end - begin));
    }
    return x;
  }

  static int64_t CounterSum(const std::vector<torch::Tensor>& tensors) {
    int64_t sum = 0;
    for (const torch::Tensor& t : tensors) sum += t._version();
    return sum;
  }

  // d(root)/d(params of `version`) accumulated into gradient_sum; returns
  // d(root)/d(input) when `input` requires grad.
  absl::StatusOr<torch::Tensor> Differentiate(const torch::Tensor& root,
                                              const torch::Tensor& seed,
                                              const torch::Tensor& input, int64_t version) {
    const std::vector<torch::Tensor>& params = stash->Get(version);
    std::vector<torch::Tensor> inputs = params;
    const bool wants_input = input.defined() && input.requires_grad();
    if (wants_input) inputs.push_back(input);
    std::vector<torch::Tensor> seeds;
    if (seed.defined()) seeds.push_back(seed);
    std::vector<torch::Tensor> grads = torch::autograd::grad(
        {root}, inputs, seeds, /*retain_graph=*/false, /*create_graph=*/false,
        /*allow_unused=*/true);
    // The first gradient since an update is kept as is (no zero-fill pass);
    // later ones are added to it.
    if (gradient_count == 0) gradient_sum.assign(params.size(), torch::Tensor());
    for (size_t i = 0; i < params.size(); ++i) {
      if (!grads[i].defined()) continue;
      if (gradient_sum[i].defined()) {
        gradient_sum[i].add_(grads[i]);
      } else {
        gradient_sum[i] = grads[i];
      }
    }
    ++gradient_count;
    const int64_t staleness = stash->current_version() - version;
    staleness_max = std::max(staleness_max, staleness);
    staleness_sum += staleness;
    ++backwards_checked;
    RETURN_IF_ERROR(stash->Release(version));
    return wants_input ? grads.back() : torch::Tensor();
  }

  // Where tensor `i` of `message` starts in its payload.
  static absl::StatusOr<size_t> TensorOffset(const LinkMessage& message, int i) {
    if (i >= message.header.tensors_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "message has ", message.header.tensors_size(), " tensors, need ", i + 1));
    }
    size_t offset = 0;
    for (int j = 0; j < i; ++j) offset += message.header.tensors(j).payload_bytes();
    return offset;
  }

  // Decodes tensor `i` of `message` (activations or gradients) onto the
  // stage's device.
  absl::StatusOr<torch::Tensor> Decode(const LinkMessage& message, int i) {
    ASSIGN_OR_RETURN(const size_t offset, TensorOffset(message, i));
    // int8/int4 payloads are decoded on the GPU when the build has the
    // kernels; the rest are decoded on the CPU and copied.
    const int cuda_device = device.is_cuda() ? std::max<int>(0, device.index()) : -1;
    ASSIGN_OR_RETURN(torch::Tensor t, DecodeTensor(message.header.tensors(i), message.payload,
                                                   offset, cuda_device, &device_checks));
    return t.to(device);
  }

  // The targets (tensor 1) of `message`, for the loss: decoded and
  // range-checked on the host, where they arrived, then moved to the
  // device. Only the stage that uses them looks inside.
  absl::StatusOr<torch::Tensor> TargetsForLoss(const LinkMessage& message) {
    ASSIGN_OR_RETURN(const size_t offset, TensorOffset(message, 1));
    ASSIGN_OR_RETURN(torch::Tensor t, DecodeTensor(message.header.tensors(1), message.payload,
                                                   offset));
    if (t.numel() > 0) {
      const int64_t classes = NumTargetClasses(job);
      const auto [low, high] = torch::aminmax(t);
      if (low.item<int64_t>() < 0 || high.item<int64_t>() >= classes) {  // host tensors
        return absl::InvalidArgumentError("targets out of range");
      }
    }
    if (!device.is_cuda()) return t;
    return t.pin_memory().to(device, /*non_blocking=*/true);
  }

  // How targets travel on a link whose first tensor is encoded as
  // `encoding`: with compression on, the int64 targets (byte tokens or
  // labels, mostly zero bytes) are zstd'd too.
  static WireEncoding TargetEncoding(const WireEncoding& encoding) {
    WireEncoding targets;
    targets.zstd = encoding.codec != v1::CODEC_NONE || encoding.zstd;
    return targets;
  }

  // Appends the targets of `in` to `out` for a link encoded as `encoding`:
  // their bytes as they came when they already travel that way, else
  // re-encoded on the host. They never visit the device.
  static absl::Status AppendTargets(const LinkMessage& in, const WireEncoding& encoding,
                                    LinkMessage* out) {
    ASSIGN_OR_RETURN(const size_t offset, TensorOffset(in, 1));
    const v1::TensorHeader& header = in.header.tensors(1);
    const WireEncoding wanted = TargetEncoding(encoding);
    if (header.codec() == v1::CODEC_NONE && header.zstd() == wanted.zstd) {
      RETURN_IF_ERROR(CheckTensorHeader(header));
      if (offset > in.payload.size() || in.payload.size() - offset < header.payload_bytes()) {
        return absl::InvalidArgumentError("targets run past the payload");
      }
      *out->header.add_tensors() = header;
      out->payload.append(in.payload, offset, header.payload_bytes());
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(torch::Tensor targets, DecodeTensor(header, in.payload, offset));
    return EncodeTensor(targets, out->header.add_tensors(), &out->payload, wanted);
  }

  // A message for the next stage (or, for gradients, the one before):
  // `tensors` encoded, the first as `encoding` says, the rest (stage 0's
  // targets) raw; then, with `targets_from`, that message's targets.
  absl::StatusOr<LinkMessage> MakeMessage(const v1::LinkHeader& like,
                                          v1::MessageKind kind,
                                          const std::vector<torch::Tensor>& tensors,
                                          const WireEncoding& encoding = {},
                                          const LinkMessage* targets_from = nullptr) {
    LinkMessage out;
    out.header.set_kind(kind);
    out.header.set_microbatch(like.microbatch());
    out.header.set_step(like.step());
    out.header.set_epoch(like.epoch());
    out.header.set_from_stage(placement.stage);
    *out.header.mutable_weight_versions() = like.weight_versions();
    for (size_t i = 0; i < tensors.size(); ++i) {
      RETURN_IF_ERROR(EncodeTensor(tensors[i], out.header.add_tensors(), &out.payload,
                                   i == 0 ? encoding : TargetEncoding(encoding)));
    }
    if (targets_from != nullptr) RETURN_IF_ERROR(AppendTargets(*targets_from, encoding, &out));
    return out;
  }

  absl::StatusOr<LinkMessage> FromBatch(Batch batch, v1::MessageKind kind, int step,
                                        uint64_t microbatch) {
    v1::LinkHeader header;
    header.set_step(step);
    header.set_microbatch(microbatch);
    return MakeMessage(header, kind, {batch.inputs, batch.targets});
  }
};

// Runs `body`, turning LibTorch exceptions into INTERNAL errors.
template <typename Fn>
auto GuardTorch(const char* what, Fn&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<StageRuntime>> StageRuntime::Create(
    const v1::JobSpec& job, const StagePlacement& placement,
    const RuntimeOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->job = job;
  impl->shard_microbatches = std::max(1, job.microbatches());  // one pipeline, until SetDataShard
  impl->shard_block = impl->shard_microbatches;
  impl->placement = placement;
  impl->options = options;
  return GuardTorch("building stage", [&]() -> absl::StatusOr<std::unique_ptr<StageRuntime>> {
    impl->device = torch::Device(options.device);
    impl->layers = BuildLayers(job, placement.layer_begin, placement.layer_end);
    std::vector<torch::Tensor> parameters;
    for (auto& layer : impl->layers) {
      layer->to(impl->device);
      impl->layer_offsets.push_back(parameters.size());
      for (const torch::Tensor& p : layer->parameters()) parameters.push_back(p);
    }
    if (job.has_llama() && job.llama().tie_embeddings()) {
      auto index_of = [&](int layer, const std::string& name) -> std::optional<size_t> {
        if (layer < placement.layer_begin || layer >= placement.layer_end) return std::nullopt;
        const std::vector<ParameterSpec> specs = LayerParameters(job, layer);
        for (size_t i = 0; i < specs.size(); ++i) {
          if (specs[i].name == name) return impl->layer_offsets[layer - placement.layer_begin] + i;
        }
        return std::nullopt;
      };
      impl->tied_embedding = index_of(0, "embed_tokens.weight");
      impl->tied_head = index_of(NumLayers(job) - 1, "lm_head.weight");
    }
    impl->stash = std::make_unique<WeightStash>(std::move(parameters));
    // The stash now holds the initial weights (its own handles on the same
    // storage); the modules' copies would pin them for the runtime's life,
    // a whole extra copy of the stage's parameters once they are updated or
    // restored. The modules keep only their structure.
    {
      torch::NoGradGuard no_grad;
      for (auto& layer : impl->layers) {
        for (torch::Tensor& p : layer->parameters()) p.set_data(torch::empty({0}, p.options()));
      }
    }
    impl->optimizer = MakeOptimizer(job.optimizer());
    if (placement.stage == 0) {
      ASSIGN_OR_RETURN(impl->dataset, OpenDataset(job));
    }
    return std::unique_ptr<StageRuntime>(new StageRuntime(std::move(impl)));
  });
}

StageRuntime::StageRuntime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StageRuntime::~StageRuntime() = default;

bool StageRuntime::is_first() const { return impl_->is_first(); }
bool StageRuntime::is_last() const { return impl_->is_last(); }
size_t StageRuntime::pending_microbatches() const { return impl_->pending.size(); }
std::string StageRuntime::device() const { return impl_->device.str(); }

int StageRuntime::num_eval_microbatches() const {
  return impl_->dataset ? static_cast<int>(impl_->dataset->num_eval_microbatches()) : 0;
}

absl::StatusOr<LinkMessage> StageRuntime::LoadTrainMicrobatch(int step, int index) {
  return LoadTrainMicrobatchById(
      step, static_cast<int64_t>(step) * impl_->shard_microbatches + index);
}

void StageRuntime::SetDataShard(int pipelines, int pipeline, int start_step, int64_t base,
                                int microbatches, int64_t block) {
  Impl& s = *impl_;
  s.shard_pipelines = std::max(1, pipelines);
  s.shard_pipeline = pipeline;
  s.shard_start_step = start_step;
  s.shard_base = base;
  s.shard_microbatches = microbatches > 0 ? microbatches : std::max(1, s.job.microbatches());
  s.shard_block = block > 0 ? block : int64_t{s.shard_pipelines} * s.shard_microbatches;
  s.drawn_first = s.drawn_last = -1;
}

std::optional<StageRuntime::DataDrawn> StageRuntime::data_drawn() const {
  const Impl& s = *impl_;
  if (s.drawn_first < 0) return std::nullopt;
  DataDrawn drawn{DataIndexOf(s.drawn_first), DataIndexOf(s.drawn_last), s.shard_pipelines};
  if (s.shard_block != int64_t{s.shard_pipelines} * s.shard_microbatches) {
    drawn.per_block = s.shard_microbatches;
    drawn.block = s.shard_block;
  }
  return drawn;
}

int64_t StageRuntime::DataIndexOf(int64_t microbatch) const {
  const Impl& s = *impl_;
  const int64_t m = s.shard_microbatches;
  return s.shard_base + (microbatch / m - s.shard_start_step) * s.shard_block +
         (microbatch % m) * s.shard_pipelines + s.shard_pipeline;
}

absl::StatusOr<LinkMessage> StageRuntime::LoadTrainMicrobatchById(int step, int64_t microbatch) {
  if (!impl_->dataset) return absl::FailedPreconditionError("not stage 0");
  const int64_t index = DataIndexOf(microbatch);
  if (microbatch < 0 || microbatch / impl_->shard_microbatches < impl_->shard_start_step) {
    return absl::InvalidArgumentError(absl::StrCat("microbatch ", microbatch,
                                                   " is before this pipeline's data"));
  }
  Impl& s = *impl_;
  s.drawn_first = s.drawn_first < 0 ? microbatch : std::min(s.drawn_first, microbatch);
  s.drawn_last = std::max(s.drawn_last, microbatch);
  return GuardTorch("loading data", [&]() -> absl::StatusOr<LinkMessage> {
    return impl_->FromBatch(impl_->dataset->TrainMicrobatch(index),
                            v1::MESSAGE_KIND_ACTIVATION, step, static_cast<uint64_t>(microbatch));
  });
}

absl::StatusOr<LinkMessage> StageRuntime::LoadEvalMicrobatch(int index) {
  if (!impl_->dataset) return absl::FailedPreconditionError("not stage 0");
  return GuardTorch("loading data", [&]() -> absl::StatusOr<LinkMessage> {
    return impl_->FromBatch(impl_->dataset->EvalMicrobatch(index),
                            v1::MESSAGE_KIND_EVAL, 0, index);
  });
}

absl::StatusOr<LinkMessage> StageRuntime::Forward(const LinkMessage& input) {
  Impl& s = *impl_;
  const bool train = input.header.kind() == v1::MESSAGE_KIND_ACTIVATION;
  return GuardTorch("forward", [&]() -> absl::StatusOr<LinkMessage> {
    ASSIGN_OR_RETURN(torch::Tensor x, s.Decode(input, 0));
    if (!train) {
      torch::NoGradGuard no_grad;
      ASSIGN_OR_RETURN(LinkMessage out,
                       s.MakeMessage(input.header, v1::MESSAGE_KIND_EVAL,
                                     {s.RunLayers(x, s.EvalParams())},
                                     s.options.activation_encoding, &input));
      RETURN_IF_ERROR(s.device_checks.Verify());  // the message's copy synchronised
      return out;
    }
    if (s.pending.count(input.header.microbatch()) > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "microbatch ", input.header.microbatch(), " already in flight"));
    }
    if (!s.is_first()) x.requires_grad_(true);
    const int64_t version = s.stash->Acquire();
    const std::vector<torch::Tensor>& params = s.stash->Get(version);
    torch::Tensor y = s.RunLayers(x, params);
    v1::LinkHeader header = input.header;
    header.add_weight_versions(version);
    absl::StatusOr<LinkMessage> out = s.MakeMessage(header, v1::MESSAGE_KIND_ACTIVATION, {y},
                                                    s.options.activation_encoding, &input);
    // The message's copy to the host synchronised past the input's decode.
    absl::Status checked = out.ok() ? s.device_checks.Verify() : out.status();
    if (!checked.ok()) {
      (void)s.stash->Release(version);
      return checked;
    }
    s.pending[input.header.microbatch()] = {x, y, version, Impl::CounterSum(params)};
    return out;
  });
}

absl::StatusOr<std::optional<LinkMessage>> StageRuntime::Backward(
    const LinkMessage& gradient) {
  Impl& s = *impl_;
  auto it = s.pending.find(gradient.header.microbatch());
  if (it == s.pending.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradient for microbatch ", gradient.header.microbatch(),
        " which is not in flight here"));
  }
  Impl::Pending pending = std::move(it->second);
  s.pending.erase(it);
  const int stage = s.placement.stage;
  if (gradient.header.weight_versions_size() <= stage ||
      gradient.header.weight_versions(stage) != pending.version) {
    (void)s.stash->Release(pending.version);
    return absl::InvalidArgumentError(absl::StrCat(
        "gradient of microbatch ", gradient.header.microbatch(), " names weight version ",
        gradient.header.weight_versions_size() > stage ? gradient.header.weight_versions(stage)
                                                       : -1,
        " for stage ", stage, " but its forward used version ", pending.version));
  }
  // The stashed weights must be exactly as the forward saw them.
  if (!s.stash->alive(pending.version) ||
      Impl::CounterSum(s.stash->Get(pending.version)) != pending.weight_counter_sum) {
    return absl::InternalError(absl::StrCat("weight version ", pending.version,
                                            " changed or vanished before its backward"));
  }
  return GuardTorch("backward", [&]() -> absl::StatusOr<std::optional<LinkMessage>> {
    ASSIGN_OR_RETURN(torch::Tensor grad, s.Decode(gradient, 0));
    if (!grad.sizes().equals(pending.output.sizes())) {
      (void)s.stash->Release(pending.version);
      return absl::InvalidArgumentError("gradient shape differs from the activation");
    }
    ASSIGN_OR_RETURN(torch::Tensor input_grad,
                     s.Differentiate(pending.output, grad, pending.input, pending.version));
    if (s.is_first()) return std::optional<LinkMessage>();
    ASSIGN_OR_RETURN(LinkMessage up, s.MakeMessage(gradient.header, v1::MESSAGE_KIND_GRADIENT,
                                                   {input_grad}, s.options.gradient_encoding));
    // A bad gradient has by now been added to gradient_sum: drop the lot.
    if (absl::Status checked = s.device_checks.Verify(); !checked.ok()) {
      s.DropGradients();
      return checked;
    }
    return std::optional<LinkMessage>(std::move(up));
  });
}

absl::StatusOr<LastStageResult> StageRuntime::ForwardLoss(const LinkMessage& input) {
  Impl& s = *impl_;
  return GuardTorch("forward/backward", [&]() -> absl::StatusOr<LastStageResult> {
    ASSIGN_OR_RETURN(torch::Tensor x, s.Decode(input, 0));
    ASSIGN_OR_RETURN(torch::Tensor targets, s.TargetsForLoss(input));
    if (!s.is_first()) x.requires_grad_(true);
    const int64_t version = s.stash->Acquire();
    torch::Tensor loss = ComputeLoss(s.job, s.RunLayers(x, s.stash->Get(version)), targets);
    ASSIGN_OR_RETURN(torch::Tensor input_grad,
                     s.Differentiate(loss, torch::Tensor(), x, version));
    LastStageResult result;
    result.loss = loss.item<double>();  // the one synchronisation per microbatch
    if (absl::Status checked = s.device_checks.Verify(); !checked.ok()) {
      s.DropGradients();
      return checked;
    }
    if (!s.is_first()) {
      v1::LinkHeader header = input.header;
      header.add_weight_versions(version);
      ASSIGN_OR_RETURN(result.gradient,
                       s.MakeMessage(header, v1::MESSAGE_KIND_GRADIENT, {input_grad},
                                     s.options.gradient_encoding));
    }
    return result;
  });
}

absl::StatusOr<LinkMessage> StageRuntime::LossRoundingFloor(const LinkMessage& input,
                                                             double ulps) {
  Impl& s = *impl_;
  if (!s.is_last() || s.is_first()) {
    return absl::FailedPreconditionError("only a last stage below stage 0 has a loss gradient");
  }
  return GuardTorch("the loss's rounding floor", [&]() -> absl::StatusOr<LinkMessage> {
    ASSIGN_OR_RETURN(torch::Tensor x, s.Decode(input, 0));
    ASSIGN_OR_RETURN(torch::Tensor targets, s.TargetsForLoss(input));
    x.requires_grad_(true);
    const torch::Tensor logits = s.RunLayers(x, s.stash->Get(s.stash->current_version()));
    const torch::Tensor flat = logits.reshape({-1, logits.size(-1)});
    const torch::Tensor picked = targets.reshape({-1, 1}).to(flat.device());
    // The loss is a mean over its rows: so is the true class's share of it.
    const torch::Tensor root = flat.gather(1, picked).sum() / static_cast<double>(flat.size(0));
    std::vector<torch::Tensor> grads = torch::autograd::grad({root}, {x});
    const torch::Tensor floor = grads[0].detach().abs() * (ulps * std::ldexp(1.0, -24));
    v1::LinkHeader header = input.header;
    header.clear_tensors();
    header.clear_commitment();
    return s.MakeMessage(header, v1::MESSAGE_KIND_GRADIENT, {floor.to(torch::kFloat32)});
  });
}

absl::Status StageRuntime::EvalForward(const LinkMessage& input) {
  Impl& s = *impl_;
  return GuardTorch("eval", [&]() -> absl::Status {
    torch::NoGradGuard no_grad;
    ASSIGN_OR_RETURN(torch::Tensor x, s.Decode(input, 0));
    ASSIGN_OR_RETURN(torch::Tensor targets, s.TargetsForLoss(input));
    torch::Tensor output = s.RunLayers(x, s.EvalParams());
    const int64_t batch = targets.size(0);
    const int64_t elements = LossElements(s.job, batch);
    Impl::EvalPass& pass = s.evals[input.header.step()];
    const torch::Tensor loss =
        ComputeLoss(s.job, output, targets).to(torch::kFloat64) * static_cast<double>(elements);
    pass.loss_sum = pass.loss_sum.defined() ? pass.loss_sum + loss : loss;
    pass.elements += elements;
    pass.samples += batch;
    const torch::Tensor correct = CountCorrect(s.job, output, targets);
    if (correct.defined()) pass.correct = pass.correct.defined() ? pass.correct + correct : correct;
    return absl::OkStatus();
  });
}

EvalResult StageRuntime::TakeEvalResult(int step) {
  Impl& s = *impl_;
  EvalResult result;
  auto it = s.evals.find(step);
  if (it == s.evals.end()) return result;
  const Impl::EvalPass pass = std::move(it->second);
  s.evals.erase(it);
  result.samples = pass.samples;
  try {
    // The pass's one synchronisation; its decoded inputs were checked by it.
    if (pass.elements > 0 && pass.loss_sum.defined()) {
      result.loss = pass.loss_sum.item<double>() / pass.elements;
    }
    if (absl::Status checked = s.device_checks.Verify(); !checked.ok()) {
      return EvalResult();  // a pass with a bad input counts as none
    }
    if (s.job.has_mlp() && pass.samples > 0 && pass.correct.defined()) {
      result.accuracy = static_cast<double>(pass.correct.item<int64_t>()) / pass.samples;
    }
  } catch (const c10::Error& e) {
    return EvalResult();
  }
  return result;
}

bool StageRuntime::holds_one_tied_end() const {
  return impl_->tied_embedding.has_value() != impl_->tied_head.has_value();
}

uint64_t StageRuntime::TiedEmbeddingBytes(const v1::JobSpec& job) {
  if (!job.has_llama() || !job.llama().tie_embeddings()) return 0;
  return static_cast<uint64_t>(VocabOf(job)) * job.llama().d_model() * sizeof(float);
}

absl::Status StageRuntime::ApplyUpdate(double progress,
                                       const TiedGradientExchangeFn& exchange_tied) {
  Impl& s = *impl_;
  if (s.gradient_count == 0) return absl::OkStatus();
  if (s.options.tamper_skip_updates_after >= 0 &&
      s.updates_run++ >= s.options.tamper_skip_updates_after) {
    if (s.updates_run == s.options.tamper_skip_updates_after + 1) {
      GT_LOG(Warning) << "tampering: skipping every update from now on";
    }
    s.gradient_sum.clear();
    s.gradient_count = 0;
    return GuardTorch("a skipped update", [&]() -> absl::Status {
      std::vector<torch::Tensor> stale;
      for (const torch::Tensor& p : s.stash->Get(s.stash->current_version())) {
        stale.push_back(p.detach().clone());
      }
      if (s.options.tamper_claim_syncs) {
        std::vector<torch::Tensor> again;
        for (const torch::Tensor& p : stale) again.push_back(p.clone());
        s.stash->Publish(std::move(stale));
        s.PublishSync(std::move(again));
        return absl::OkStatus();
      }
      s.stash->Publish(std::move(stale));
      return absl::OkStatus();
    });
  }
  if (s.tied_embedding.has_value() || s.tied_head.has_value()) {
    // Embedding + head, summed here or traded with the other end: the same
    // float32 sum on both (addition commutes), before the mean.
    RETURN_IF_ERROR(GuardTorch("tied embedding", [&]() -> absl::Status {
      const std::vector<torch::Tensor>& params = s.stash->Get(s.stash->current_version());
      auto sum_of = [&](size_t i) {
        return s.gradient_sum[i].defined() ? s.gradient_sum[i] : torch::zeros_like(params[i]);
      };
      if (s.tied_embedding.has_value() && s.tied_head.has_value()) {
        const torch::Tensor both = sum_of(*s.tied_embedding) + sum_of(*s.tied_head);
        s.gradient_sum[*s.tied_embedding] = both;
        s.gradient_sum[*s.tied_head] = both.clone();
        return absl::OkStatus();
      }
      if (!exchange_tied) {
        return absl::FailedPreconditionError(
            "this stage holds one end of a tied embedding and has no peer to exchange with");
      }
      const size_t index = s.tied_embedding.has_value() ? *s.tied_embedding : *s.tied_head;
      const torch::Tensor mine = sum_of(index).to(torch::kCPU).contiguous();
      const uint64_t bytes = mine.numel() * sizeof(float);
      ASSIGN_OR_RETURN(std::string theirs,
                       exchange_tied(std::string_view(
                           static_cast<const char*>(mine.data_ptr()), bytes)));
      if (theirs.size() != bytes) {
        return absl::InternalError(absl::StrCat("the other end's tied gradient is ", theirs.size(),
                                                " bytes, not ", bytes));
      }
      const torch::Tensor other =
          torch::from_blob(theirs.data(), mine.sizes(), torch::kFloat32);
      if (!torch::isfinite(other).all().item<bool>()) {
        return absl::InvalidArgumentError("the other end's tied gradient is not finite");
      }
      s.gradient_sum[index] = (mine + other).to(s.device);
      return absl::OkStatus();
    }));
  }
  // Stage 0's backwards send nothing, so nothing has synchronised since
  // their gradients were decoded: once per update, before they count.
  if (absl::Status checked = s.device_checks.SynchronizeAndVerify(); !checked.ok()) {
    s.DropGradients();
    return checked;
  }
  RETURN_IF_ERROR(GuardTorch("optimizer step", [&]() -> absl::Status {
    const std::vector<torch::Tensor>& params = s.stash->Get(s.stash->current_version());
    for (size_t i = 0; i < params.size(); ++i) {
      if (!s.gradient_sum[i].defined()) {
        s.gradient_sum[i] = torch::zeros_like(params[i]);
      } else if (s.gradient_count > 1) {
        s.gradient_sum[i].div_(static_cast<double>(s.gradient_count));
      }
    }
    s.stash->Publish(s.optimizer->Step(params, s.gradient_sum,
                                       LearningRateScale(s.job.optimizer(), progress)));
    s.gradient_sum.clear();
    s.gradient_count = 0;
    return absl::OkStatus();
  }));
  const int limit = s.options.max_weight_versions;
  if (limit > 0 && static_cast<int>(s.stash->versions_alive()) > limit) {
    return absl::InternalError(absl::StrCat(s.stash->versions_alive(),
                                            " weight versions alive; the schedule allows ",
                                            limit));
  }
  return absl::OkStatus();
}

StashStats StageRuntime::stash_stats() const {
  const Impl& s = *impl_;
  StashStats stats;
  stats.current_version = s.stash->current_version();
  stats.versions_alive = static_cast<int>(s.stash->versions_alive());
  stats.max_versions_alive = static_cast<int>(s.stash->max_versions_alive());
  stats.bytes_alive = s.stash->bytes_alive();
  stats.references = s.stash->references();
  stats.staleness_max = s.staleness_max;
  stats.staleness_mean =
      s.backwards_checked > 0 ? static_cast<double>(s.staleness_sum) / s.backwards_checked : 0;
  stats.backwards_checked = s.backwards_checked;
  return stats;
}

int StageRuntime::layer_begin() const { return impl_->placement.layer_begin; }
int StageRuntime::layer_end() const { return impl_->placement.layer_end; }
const StagePlacement& StageRuntime::placement() const { return impl_->placement; }

int StageRuntime::DropInFlight() {
  Impl& s = *impl_;
  const int dropped = static_cast<int>(s.pending.size());
  for (const auto& [microbatch, pending] : s.pending) {
    (void)s.stash->Release(pending.version);
  }
  s.pending.clear();
  s.gradient_sum.clear();
  s.gradient_count = 0;
  s.evals.clear();
  return dropped;
}

int64_t StageRuntime::current_weight_version() const { return impl_->stash->current_version(); }

absl::StatusOr<std::vector<v1::LayerCheckpoint>> StageRuntime::ExportCheckpoint(
    int step, bool weights_only) const {
  const Impl& s = *impl_;
  return GuardTorch("exporting a checkpoint",
                    [&]() -> absl::StatusOr<std::vector<v1::LayerCheckpoint>> {
    const std::vector<torch::Tensor>& params = s.stash->Get(s.stash->current_version());
    const std::vector<std::vector<torch::Tensor>> state =
        weights_only ? std::vector<std::vector<torch::Tensor>>() : s.optimizer->State();
    std::vector<v1::LayerCheckpoint> out;
    for (size_t i = 0; i < s.layers.size(); ++i) {
      const auto [begin, end] = s.LayerParams(static_cast<size_t>(i), params.size());
      v1::LayerCheckpoint& layer = out.emplace_back();
      layer.set_layer(s.placement.layer_begin + static_cast<int>(i));
      layer.set_step(step);
      layer.set_optimizer_steps(s.optimizer->steps());
      layer.set_state_per_param(state.empty() ? 0 : static_cast<int>(state[0].size()));
      std::string* payload = layer.mutable_payload();
      for (size_t p = begin; p < end; ++p) {
        RETURN_IF_ERROR(EncodeTensor(params[p], layer.add_params(), payload));
      }
      for (size_t p = begin; p < end && !state.empty(); ++p) {
        for (const torch::Tensor& t : state[p]) {
          RETURN_IF_ERROR(EncodeTensor(t, layer.add_optimizer_state(), payload));
        }
      }
      if (s.outer != nullptr && !weights_only) {
        layer.set_outer_rounds(s.outer->rounds());
        for (size_t p = begin; p < end; ++p) {
          RETURN_IF_ERROR(EncodeTensor(s.outer->outer_weights()[p], layer.add_outer_weights(),
                                       payload));
        }
        for (size_t p = begin; p < end && !s.outer->momentum().empty(); ++p) {
          RETURN_IF_ERROR(EncodeTensor(s.outer->momentum()[p], layer.add_outer_momentum(),
                                       payload));
        }
      }
    }
    return out;
  });
}

StageRuntime::WeightsExport StageRuntime::ExportWeightsLater(bool with_optimizer_state) const {
  const Impl& s = *impl_;
  std::vector<torch::Tensor> params = s.stash->Get(s.stash->current_version());
  // The optimizer makes new state tensors at each step (worker/optimizer.h):
  // these stay as they are now.
  std::vector<std::vector<torch::Tensor>> state;
  if (with_optimizer_state) state = s.optimizer->State();
  std::vector<std::pair<size_t, size_t>> ranges;
  for (size_t i = 0; i < s.layers.size(); ++i) ranges.push_back(s.LayerParams(i, params.size()));
  return [params = std::move(params), state = std::move(state), ranges = std::move(ranges),
          layer_begin = s.placement.layer_begin, optimizer_steps = s.optimizer->steps()]()
             -> absl::StatusOr<std::vector<v1::LayerCheckpoint>> {
    return GuardTorch("exporting kept weights",
                      [&]() -> absl::StatusOr<std::vector<v1::LayerCheckpoint>> {
      std::vector<v1::LayerCheckpoint> out;
      for (size_t i = 0; i < ranges.size(); ++i) {
        v1::LayerCheckpoint& layer = out.emplace_back();
        layer.set_layer(layer_begin + static_cast<int>(i));
        layer.set_optimizer_steps(optimizer_steps);
        layer.set_state_per_param(state.empty() ? 0 : static_cast<int>(state[0].size()));
        for (size_t p = ranges[i].first; p < ranges[i].second; ++p) {
          RETURN_IF_ERROR(EncodeTensor(params[p], layer.add_params(), layer.mutable_payload()));
        }
        for (size_t p = ranges[i].first; p < ranges[i].second && !state.empty(); ++p) {
          for (const torch::Tensor& t : state[p]) {
            RETURN_IF_ERROR(
                EncodeTensor(t, layer.add_optimizer_state(), layer.mutable_payload()));
          }
        }
      }
      return out;
    });
  };
}

absl::Status StageRuntime::ResetOptimizer() {
  return impl_->optimizer->Restore({}, 0);
}

uint64_t StageRuntime::OptimizerStateBytes() const {
  uint64_t bytes = 0;
  for (const std::vector<torch::Tensor>& per_param : impl_->optimizer->State()) {
    for (const torch::Tensor& t : per_param) {
      bytes += static_cast<uint64_t>(t.numel()) * t.element_size();
    }
  }
  return bytes;
}

uint64_t StageRuntime::WeightBytes() const {
  const Impl& s = *impl_;
  uint64_t bytes = 0;
  for (const torch::Tensor& p : s.stash->Get(s.stash->current_version())) {
    bytes += static_cast<uint64_t>(p.numel()) * p.element_size();
  }
  return bytes;
}

uint64_t StageRuntime::StateBytes() const {
  const Impl& s = *impl_;
  uint64_t bytes = WeightBytes();
  for (const std::vector<torch::Tensor>& per_param : s.optimizer->State()) {
    for (const torch::Tensor& t : per_param) {
      bytes += static_cast<uint64_t>(t.numel()) * t.element_size();
    }
  }
  if (s.outer != nullptr) {
    for (const auto* tensors : {&s.outer->outer_weights(), &s.outer->momentum()}) {
      for (const torch::Tensor& t : *tensors) {
        bytes += static_cast<uint64_t>(t.numel()) * t.element_size();
      }
    }
  }
  return bytes;
}

absl::Status StageRuntime::StreamCheckpoint(
    int step, const std::function<bool(const v1::LayerStateChunk&)>& emit) const {
  const Impl& s = *impl_;
  return GuardTorch("streaming a checkpoint", [&]() -> absl::Status {
    const std::vector<torch::Tensor>& params = s.stash->Get(s.stash->current_version());
    const std::vector<std::vector<torch::Tensor>> state = s.optimizer->State();
    for (size_t i = 0; i < s.layers.size(); ++i) {
      const auto [begin, end] = s.LayerParams(i, params.size());
      std::vector<torch::Tensor> tensors;  // params, then each one's state
      v1::LayerCheckpoint header;
      header.set_layer(s.placement.layer_begin + static_cast<int>(i));
      header.set_step(step);
      header.set_optimizer_steps(s.optimizer->steps());
      header.set_state_per_param(state.empty() ? 0 : static_cast<int>(state[0].size()));
      auto describe = [&](const torch::Tensor& t, v1::TensorHeader* h) {
        for (int64_t dim : t.sizes()) h->add_shape(dim);
        h->set_dtype(v1::DTYPE_FLOAT32);
        h->set_codec(v1::CODEC_NONE);
        h->set_payload_bytes(static_cast<uint64_t>(t.numel()) * sizeof(float));
        tensors.push_back(t);
      };
      for (size_t p = begin; p < end; ++p) describe(params[p], header.add_params());
      for (size_t p = begin; p < end && !state.empty(); ++p) {
        for (const torch::Tensor& t : state[p]) describe(t, header.add_optimizer_state());
      }
      if (s.outer != nullptr) {
        header.set_outer_rounds(s.outer->rounds());
        for (size_t p = begin; p < end; ++p) {
          describe(s.outer->outer_weights()[p], header.add_outer_weights());
        }
        for (size_t p = begin; p < end && !s.outer->momentum().empty(); ++p) {
          describe(s.outer->momentum()[p], header.add_outer_momentum());
        }
      }
      LayerStateChunker chunker(header, DeclaredPayloadBytes(header), emit);
      // One tensor on the host at a time (a copy only for a device tensor).
      for (const torch::Tensor& tensor : tensors) {
        if (tensor.scalar_type() != torch::kFloat32) {
          return absl::InternalError("a stage tensor that is not float32");
        }
        const torch::Tensor host = tensor.detach().to(torch::kCPU).contiguous();
        RETURN_IF_ERROR(chunker.Append(
            absl::string_view(static_cast<const char*>(host.data_ptr()),
                              static_cast<size_t>(host.numel()) * sizeof(float))));
      }
      RETURN_IF_ERROR(chunker.Finish());
    }
    return absl::OkStatus();
  });
}

absl::Status StageRuntime::RestoreCheckpoint(const std::vector<v1::LayerCheckpoint>& layers) {
  Impl& s = *impl_;
  if (!s.pending.empty()) {
    return absl::FailedPreconditionError("restore with microbatches in flight");
  }
  return GuardTorch("restoring a checkpoint", [&]() -> absl::Status {
    std::vector<torch::Tensor> params = s.stash->Get(s.stash->current_version());
    std::vector<std::vector<torch::Tensor>> state = s.optimizer->State();
    std::optional<Impl::RestoredOuter> outer;
    int per_param = state.empty() ? 0 : static_cast<int>(state[0].size());
    for (const v1::LayerCheckpoint& c : layers) {
      per_param = std::max(per_param, c.state_per_param());
    }
    int64_t optimizer_steps = s.optimizer->steps();
    // Missing state (a layer never checkpointed, or an optimizer that has
    // not stepped yet) starts from zeros.
    if (per_param > 0 && state.size() != params.size()) {
      state.assign(params.size(), {});
      for (size_t p = 0; p < params.size(); ++p) {
        for (int k = 0; k < per_param; ++k) state[p].push_back(torch::zeros_like(params[p]));
      }
    }
    for (const v1::LayerCheckpoint& c : layers) {
      const int i = c.layer() - s.placement.layer_begin;
      if (i < 0 || i >= static_cast<int>(s.layers.size())) {
        return absl::InvalidArgumentError(absl::StrCat("checkpoint of layer ", c.layer(),
                                                       ", not of this stage"));
      }
      const auto [begin, end] = s.LayerParams(static_cast<size_t>(i), params.size());
      const size_t count = end - begin;
      if (static_cast<size_t>(c.params_size()) != count ||
          (c.state_per_param() > 0 &&
           static_cast<size_t>(c.optimizer_state_size()) != count * c.state_per_param()) ||
          (c.outer_weights_size() != 0 && static_cast<size_t>(c.outer_weights_size()) != count) ||
          (c.outer_momentum_size() != 0 &&
           static_cast<size_t>(c.outer_momentum_size()) != count)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint of layer ", c.layer(), " has ", c.params_size(), " parameters, the model ",
            count));
      }
      size_t offset = 0;
      auto next = [&](const v1::TensorHeader& header,
                      const torch::Tensor& like) -> absl::StatusOr<torch::Tensor> {
        torch::Tensor t;
        if (header.dtype() == v1::DTYPE_FLOAT32 && header.codec() == v1::CODEC_NONE &&
            !header.zstd() && header.payload_bytes() == like.numel() * sizeof(float) &&
            offset + header.payload_bytes() <= c.payload().size()) {
          // A view of the payload, not a copy: the weights are cloned once
          // below (Publish) and the optimizer state by Restore, so a layer
          // is never decoded into a second full copy beside its payload.
          t = torch::from_blob(const_cast<char*>(c.payload().data()) + offset, like.sizes(),
                               torch::kFloat32);
          if (!torch::isfinite(t).all().item<bool>()) {
            return absl::InvalidArgumentError(absl::StrCat(
                "checkpoint of layer ", c.layer(), " holds a value that is not finite"));
          }
        } else {
          ASSIGN_OR_RETURN(t, DecodeTensor(header, c.payload(), offset));
        }
        offset += header.payload_bytes();
        if (t.sizes() != like.sizes()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "checkpoint of layer ", c.layer(), " does not fit the model's shapes"));
        }
        return t.to(like.device());
      };
      for (size_t p = 0; p < count; ++p) {
        ASSIGN_OR_RETURN(params[begin + p], next(c.params(p), params[begin + p]));
      }
      for (size_t p = 0; p < count && c.state_per_param() > 0; ++p) {
        for (int k = 0; k < c.state_per_param(); ++k) {
          ASSIGN_OR_RETURN(state[begin + p][k],
                           next(c.optimizer_state(p * c.state_per_param() + k), params[begin + p]));
        }
      }
      if (c.outer_weights_size() > 0) {
        if (!outer.has_value()) {
          outer.emplace();
          outer->weights.resize(params.size());
          outer->momentum.resize(params.size());
        }
        for (size_t p = 0; p < count; ++p) {
          ASSIGN_OR_RETURN(torch::Tensor t, next(c.outer_weights(p), params[begin + p]));
          outer->weights[begin + p] = t.to(torch::kCPU).clone();
        }
        for (size_t p = 0; p < static_cast<size_t>(c.outer_momentum_size()); ++p) {
          ASSIGN_OR_RETURN(torch::Tensor t, next(c.outer_momentum(p), params[begin + p]));
          outer->momentum[begin + p] = t.to(torch::kCPU).clone();
        }
        outer->rounds = std::max(outer->rounds, c.outer_rounds());
      }
      optimizer_steps = std::max(optimizer_steps, c.optimizer_steps());
    }
    std::vector<torch::Tensor> copies;
    for (const torch::Tensor& p : params) copies.push_back(p.detach().clone());
    s.PublishSync(std::move(copies));
    if (outer.has_value()) {
      // Layers restored without an outer state take their weights as outer
      // weights; momentum is kept only if every layer had one.
      bool all_momentum = true;
      for (size_t p = 0; p < params.size(); ++p) {
        if (!outer->weights[p].defined()) outer->weights[p] = params[p].detach().to(torch::kCPU).clone();
        all_momentum = all_momentum && outer->momentum[p].defined();
      }
      if (!all_momentum) outer->momentum.clear();
      s.restored_outer = std::move(*outer);
      s.outer = nullptr;  // StartOuter takes it
      s.eval_params.clear();
    }
    return s.optimizer->Restore(state, optimizer_steps);
  });
}

absl::StatusOr<std::vector<v1::LayerWeights>> StageRuntime::ExportWeights(
    const WireEncoding& encoding) const {
  const Impl& s = *impl_;
  return GuardTorch("exporting weights", [&]() -> absl::StatusOr<std::vector<v1::LayerWeights>> {
    const std::vector<torch::Tensor>& params = s.stash->Get(s.stash->current_version());
    std::vector<v1::LayerWeights> out;
    for (size_t i = 0; i < s.layers.size(); ++i) {
      const auto [begin, end] = s.LayerParams(static_cast<size_t>(i), params.size());
      v1::LayerWeights& layer = out.emplace_back();
      layer.set_layer(s.placement.layer_begin + static_cast<int>(i));
      for (size_t p = begin; p < end; ++p) {
        RETURN_IF_ERROR(
            EncodeTensor(params[p].detach(), layer.add_params(), layer.mutable_payload(), encoding));
      }
    }
    return out;
  });
}

absl::Status StageRuntime::AverageWeights(const std::vector<v1::LayerWeights>& peers,
                                          bool adopt) {
  Impl& s = *impl_;
  if (peers.empty()) return absl::OkStatus();
  return GuardTorch("averaging replica weights", [&]() -> absl::Status {
    const std::vector<torch::Tensor>& current = s.stash->Get(s.stash->current_version());
    std::vector<torch::Tensor> sums(current.size());
    std::vector<int> counts(current.size(), 0);
    for (const v1::LayerWeights& peer : peers) {
      const int i = peer.layer() - s.placement.layer_begin;
      if (i < 0 || i >= static_cast<int>(s.layers.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("replica weights of layer ", peer.layer(), ", not of this stage"));
      }
      const auto [begin, end] = s.LayerParams(static_cast<size_t>(i), current.size());
      if (static_cast<size_t>(peer.params_size()) != end - begin) {
        return absl::InvalidArgumentError(absl::StrCat("replica weights of layer ", peer.layer(),
                                                       " have ", peer.params_size(),
                                                       " tensors, the model ", end - begin));
      }
      size_t offset = 0;
      for (size_t p = begin; p < end; ++p) {
        const v1::TensorHeader& header = peer.params(static_cast<int>(p - begin));
        ASSIGN_OR_RETURN(torch::Tensor t, DecodeTensor(header, peer.payload(), offset));
        offset += header.payload_bytes();
        if (t.sizes() != current[p].sizes()) {  // (DecodeTensor checked finiteness)
          return absl::InvalidArgumentError(absl::StrCat(
              "replica weights of layer ", peer.layer(), " do not fit the model's shapes"));
        }
        t = t.to(current[p].device(), current[p].scalar_type());
        sums[p] = sums[p].defined() ? sums[p] + t : t;
      }
      for (size_t p = begin; p < end; ++p) ++counts[p];
    }
    std::vector<torch::Tensor> next;
    for (size_t p = 0; p < current.size(); ++p) {
      torch::Tensor mine = current[p].detach();
      if (counts[p] == 0) {
        next.push_back(mine.clone());
      } else if (adopt) {
        next.push_back(sums[p] / static_cast<double>(counts[p]));
      } else {
        next.push_back((mine + sums[p]) / (1.0 + counts[p]));
      }
    }
    s.PublishSync(std::move(next));
    return absl::OkStatus();
  });
}

namespace {

std::string DigestOf(const std::vector<torch::Tensor>& tensors) {
  EVP_MD_CTX* context = EVP_MD_CTX_new();
  EVP_DigestInit_ex(context, EVP_sha256(), nullptr);
  for (const torch::Tensor& t : tensors) {
    torch::Tensor host = t.detach().to(torch::kCPU).contiguous();
    EVP_DigestUpdate(context, host.data_ptr(), host.numel() * host.element_size());
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_DigestFinal_ex(context, digest, &size);
  EVP_MD_CTX_free(context);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < size; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

}  // namespace

absl::Status StageRuntime::StartOuter(const OuterSettings& settings) {
  Impl& s = *impl_;
  return GuardTorch("starting the outer optimizer", [&]() -> absl::Status {
    s.outer = std::make_unique<OuterOptimizer>(
        OuterStepOptions{settings.lr, settings.momentum, /*nesterov=*/true});
    s.outer->Reset(s.stash->Get(s.stash->current_version()));
    s.eval_params.clear();
    if (s.restored_outer.has_value()) {
      // A checkpoint's outer optimizer: resumed exactly.
      Impl::RestoredOuter restored = *std::move(s.restored_outer);
      s.restored_outer.reset();
      RETURN_IF_ERROR(s.outer->Restore(restored.weights, restored.momentum, restored.rounds));
    }
    s.outer_encoder = std::make_unique<ErrorFeedbackEncoder>(settings.encoding);
    s.mean_encoder = std::make_unique<ErrorFeedbackEncoder>(settings.encoding);
    s.outer_sent_from.clear();
    return absl::OkStatus();
  });
}

bool StageRuntime::outer_started() const { return impl_->outer != nullptr; }

int64_t StageRuntime::outer_rounds() const {
  return impl_->outer == nullptr ? 0 : impl_->outer->rounds();
}

absl::StatusOr<std::vector<v1::LayerWeights>> StageRuntime::ExportOuterState() {
  Impl& s = *impl_;
  if (s.outer == nullptr) return absl::FailedPreconditionError("no outer optimizer (StartOuter)");
  return GuardTorch("exporting the outer state",
                    [&]() -> absl::StatusOr<std::vector<v1::LayerWeights>> {
    ErrorFeedbackEncoder lossless{WireEncoding{}};
    ASSIGN_OR_RETURN(std::vector<v1::LayerWeights> out,
                     EncodeStageTensors(s.outer->outer_weights(), &lossless));
    if (!s.outer->momentum().empty()) {
      ASSIGN_OR_RETURN(std::vector<v1::LayerWeights> momentum,
                       EncodeStageTensors(s.outer->momentum(), &lossless));
      for (v1::LayerWeights& layer : momentum) out.push_back(std::move(layer));
    }
    return out;
  });
}

absl::Status StageRuntime::AdoptOuterState(const std::vector<v1::LayerWeights>& state,
                                           int64_t rounds) {
  Impl& s = *impl_;
  if (s.outer == nullptr) return absl::FailedPreconditionError("no outer optimizer (StartOuter)");
  const size_t layers = s.layers.size();
  if (state.size() != layers && state.size() != 2 * layers) {
    return absl::InvalidArgumentError(absl::StrCat("an outer state of ", state.size(),
                                                   " layer entries; this stage has ", layers));
  }
  return GuardTorch("adopting the outer state", [&]() -> absl::Status {
    const std::vector<v1::LayerWeights> weights_part(state.begin(), state.begin() + layers);
    const std::vector<v1::LayerWeights> momentum_part(state.begin() + layers, state.end());
    ASSIGN_OR_RETURN(std::vector<torch::Tensor> weights,
                     DecodeStageTensors(weights_part, "an outer state"));
    std::vector<torch::Tensor> momentum;
    if (!momentum_part.empty()) {
      ASSIGN_OR_RETURN(momentum, DecodeStageTensors(momentum_part, "an outer momentum"));
    }
    for (const std::vector<torch::Tensor>* part : {&weights, &momentum}) {
      for (const torch::Tensor& t : *part) {
        if (!t.defined()) return absl::InvalidArgumentError("an outer state misses a parameter");
      }
    }
    const std::vector<torch::Tensor> own = s.outer->outer_weights();  // before Restore
    RETURN_IF_ERROR(s.outer->Restore(weights, momentum, rounds));
    s.eval_params.clear();
    const std::vector<torch::Tensor>& current = s.stash->Get(s.stash->current_version());
    std::vector<torch::Tensor> next;
    for (size_t p = 0; p < current.size(); ++p) {
      const torch::Tensor local = current[p].detach() - own[p].to(current[p].device());
      next.push_back(weights[p].to(current[p].device(), current[p].scalar_type()) + local);
    }
    s.outer_sent_from.clear();
    s.PublishSync(std::move(next));
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<v1::LayerWeights>> StageRuntime::ExportPseudoGradient() {
  Impl& s = *impl_;
  if (s.outer == nullptr) return absl::FailedPreconditionError("no outer optimizer (StartOuter)");
  return GuardTorch("exporting a pseudo-gradient",
                    [&]() -> absl::StatusOr<std::vector<v1::LayerWeights>> {
    const std::vector<torch::Tensor>& params = s.stash->Get(s.stash->current_version());
    ASSIGN_OR_RETURN(std::vector<torch::Tensor> delta, s.outer->PseudoGradient(params));
    ASSIGN_OR_RETURN(std::vector<v1::LayerWeights> out,
                     EncodeStageTensors(delta, s.outer_encoder.get()));
    s.outer_sent_from.clear();
    for (const torch::Tensor& p : params) s.outer_sent_from.push_back(p.detach());
    return out;
  });
}

// The tensors of every parameter of this stage from `layers` (entries of
// this stage's layers; params in order); undefined where no entry had them.
absl::StatusOr<std::vector<torch::Tensor>> StageRuntime::DecodeStageTensors(
    const std::vector<v1::LayerWeights>& layers, const char* what) const {
  const Impl& s = *impl_;
  const std::vector<torch::Tensor>& current = s.stash->Get(s.stash->current_version());
  std::vector<torch::Tensor> out(current.size());
  for (const v1::LayerWeights& layer : layers) {
    const int i = layer.layer() - s.placement.layer_begin;
    if (i < 0 || i >= static_cast<int>(s.layers.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " of layer ", layer.layer(), ", not of this stage"));
    }
    const auto [begin, end] = s.LayerParams(static_cast<size_t>(i), current.size());
    if (static_cast<size_t>(layer.params_size()) != end - begin) {
      return absl::InvalidArgumentError(absl::StrCat(what, " of layer ", layer.layer(), " has ",
                                                     layer.params_size(), " tensors, the model ",
                                                     end - begin));
    }
    size_t offset = 0;
    for (size_t p = begin; p < end; ++p) {
      const v1::TensorHeader& header = layer.params(static_cast<int>(p - begin));
      ASSIGN_OR_RETURN(torch::Tensor t, DecodeTensor(header, layer.payload(), offset));
      offset += header.payload_bytes();
      out[p] = std::move(t);
    }
  }
  return out;
}

absl::StatusOr<std::vector<v1::LayerWeights>> StageRuntime::EncodeStageTensors(
    const std::vector<torch::Tensor>& tensors, ErrorFeedbackEncoder* encoder) const {
  const Impl& s = *impl_;
  std::vector<v1::LayerWeights> out;
  for (size_t i = 0; i < s.layers.size(); ++i) {
    const auto [begin, end] = s.LayerParams(i, tensors.size());
    v1::LayerWeights& layer = out.emplace_back();
    layer.set_layer(s.placement.layer_begin + static_cast<int>(i));
    for (size_t p = begin; p < end; ++p) {
      RETURN_IF_ERROR(encoder->Encode(p, tensors[p], layer.add_params(), layer.mutable_payload()));
    }
  }
  return out;
}

absl::Status StageRuntime::PublishOuterWeights(const std::vector<torch::Tensor>& outer,
                                               bool keep_local_progress) {
  Impl& s = *impl_;
  const std::vector<torch::Tensor>& current = s.stash->Get(s.stash->current_version());
  std::vector<torch::Tensor> next;
  for (size_t p = 0; p < current.size(); ++p) {
    torch::Tensor w = outer[p].to(current[p].device(), current[p].scalar_type());
    if (keep_local_progress && p < s.outer_sent_from.size()) {
      w = w + (current[p].detach() - s.outer_sent_from[p].to(current[p].device()));
    } else {
      w = w.clone();
    }
    next.push_back(std::move(w));
  }
  s.outer_sent_from.clear();
  s.PublishSync(std::move(next));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PseudoGradientContribution>> StageRuntime::DecodeContributions(
    const std::vector<OuterContribution>& contributions) const {
  std::vector<PseudoGradientContribution> decoded;
  for (const OuterContribution& c : contributions) {
    PseudoGradientContribution& d = decoded.emplace_back();
    d.pipeline = c.pipeline;
    d.samples = c.samples;
    ASSIGN_OR_RETURN(d.tensors, DecodeStageTensors(c.layers, "a pseudo-gradient"));
    for (const torch::Tensor& t : d.tensors) {
      if (d.samples > 0 && !t.defined()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the pseudo-gradient of pipeline ", c.pipeline, " misses some of the stage's layers"));
      }
    }
  }
  return decoded;
}

absl::Status StageRuntime::ApplyOuterStep(const std::vector<OuterContribution>& contributions,
                                          bool keep_local_progress) {
  Impl& s = *impl_;
  if (s.outer == nullptr) return absl::FailedPreconditionError("no outer optimizer (StartOuter)");
  return GuardTorch("the outer step", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::vector<PseudoGradientContribution> decoded,
                     DecodeContributions(contributions));
    ASSIGN_OR_RETURN(std::vector<torch::Tensor> outer, s.outer->Step(std::move(decoded)));
    return PublishOuterWeights(outer, keep_local_progress);
  });
}

absl::StatusOr<std::vector<v1::LayerWeights>> StageRuntime::ReduceOuterContributions(
    const std::vector<OuterContribution>& contributions) {
  Impl& s = *impl_;
  if (s.outer == nullptr) return absl::FailedPreconditionError("no outer optimizer (StartOuter)");
  return GuardTorch("reducing pseudo-gradients",
                    [&]() -> absl::StatusOr<std::vector<v1::LayerWeights>> {
    ASSIGN_OR_RETURN(std::vector<PseudoGradientContribution> decoded,
                     DecodeContributions(contributions));
    ASSIGN_OR_RETURN(std::vector<torch::Tensor> mean, s.outer->Mean(std::move(decoded)));
    if (mean.empty()) {  // nobody trained: a zero step
      for (const torch::Tensor& o : s.outer->outer_weights()) mean.push_back(torch::zeros_like(o));
    }
    return EncodeStageTensors(mean, s.mean_encoder.get());
  });
}

absl::Status StageRuntime::ApplyOuterMean(const std::vector<v1::LayerWeights>& mean,
                                          bool keep_local_progress) {
  Impl& s = *impl_;
  if (s.outer == nullptr) return absl::FailedPreconditionError("no outer optimizer (StartOuter)");
  return GuardTorch("the outer step", [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::vector<torch::Tensor> tensors,
                     DecodeStageTensors(mean, "a mean pseudo-gradient"));
    for (const torch::Tensor& t : tensors) {
      if (!t.defined()) {
        return absl::InvalidArgumentError("a mean pseudo-gradient misses some of the stage's layers");
      }
    }
    // A replica that missed the round (it had not ended it, so exported
    // nothing since the last outer step) keeps its progress since its
    // outer weights as they were.
    if (keep_local_progress && s.outer_sent_from.empty()) {
      for (const torch::Tensor& o : s.outer->outer_weights()) s.outer_sent_from.push_back(o.clone());
    }
    ASSIGN_OR_RETURN(std::vector<torch::Tensor> outer, s.outer->StepWithMean(tensors));
    return PublishOuterWeights(outer, keep_local_progress);
  });
}

std::string StageRuntime::WeightsDigest() const {
  const Impl& s = *impl_;
  return DigestOf(s.stash->Get(s.stash->current_version()));
}

std::string StageRuntime::OuterWeightsDigest() const {
  return impl_->outer == nullptr ? "" : DigestOf(impl_->outer->outer_weights());
}

std::string StageRuntime::OptimizerStateDigest() const {
  const Impl& s = *impl_;
  std::vector<torch::Tensor> tensors;
  for (const std::vector<torch::Tensor>& per_param : s.optimizer->State()) {
    tensors.insert(tensors.end(), per_param.begin(), per_param.end());
  }
  // The step count last, little-endian (AdamW's bias correction uses it).
  const int64_t steps = s.optimizer->steps();
  torch::Tensor count = torch::empty({8}, torch::kUInt8);
  for (int i = 0; i < 8; ++i) {
    count[i] = static_cast<uint8_t>((static_cast<uint64_t>(steps) >> (8 * i)) & 0xff);
  }
  tensors.push_back(count);
  return DigestOf(tensors);
}

int64_t StageRuntime::weight_syncs() const { return impl_->weight_syncs; }

void StageRuntime::SetMaxWeightVersions(int versions) {
  impl_->options.max_weight_versions = versions;
}

void StageRuntime::SetActivationCodec(v1::Codec codec) {
  impl_->options.activation_encoding.codec = codec;
}

void StageRuntime::SetGradientCodec(v1::Codec codec) {
  impl_->options.gradient_encoding.codec = codec;
}

}  // namespace geotrain
