#include "worker/stage_runtime.h"

#include <torch/torch.h>

#include <map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor_wire.h"
#include "worker/datasets.h"
#include "worker/models.h"

namespace geotrain {

struct StageRuntime::Impl {
  v1::JobSpec job;
  StagePlacement placement;
  torch::Device device{torch::kCPU};
  std::vector<std::shared_ptr<Layer>> layers;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<Dataset> dataset;  // stage 0 only

  struct Pending {
    torch::Tensor input;   // requires grad on stages > 0
    torch::Tensor output;  // graph root
  };
  std::map<uint64_t, Pending> pending;

  double eval_loss_sum = 0;
  int64_t eval_elements = 0;
  int64_t eval_correct = 0;
  int64_t eval_samples = 0;

  bool is_first() const { return placement.stage == 0; }
  bool is_last() const { return placement.stage == placement.num_stages - 1; }

  torch::Tensor RunLayers(torch::Tensor x) {
    for (auto& layer : layers) x = layer->forward(x);
    return x;
  }

  // Decodes tensor `i` of `message` onto the stage's device.
  absl::StatusOr<torch::Tensor> Decode(const LinkMessage& message, int i) {
    if (i >= message.header.tensors_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "message has ", message.header.tensors_size(), " tensors, need ", i + 1));
    }
    size_t offset = 0;
    for (int j = 0; j < i; ++j) offset += message.header.tensors(j).payload_bytes();
    ASSIGN_OR_RETURN(torch::Tensor t,
                     DecodeTensor(message.header.tensors(i), message.payload, offset));
    return t.to(device);
  }

  absl::StatusOr<LinkMessage> MakeMessage(const v1::LinkHeader& like,
                                          v1::MessageKind kind,
                                          const std::vector<torch::Tensor>& tensors) {
    LinkMessage out;
    out.header.set_kind(kind);
    out.header.set_microbatch(like.microbatch());
    out.header.set_step(like.step());
    out.header.set_epoch(like.epoch());
    out.header.set_from_stage(placement.stage);
    for (const torch::Tensor& t : tensors) {
      RETURN_IF_ERROR(EncodeTensor(t, out.header.add_tensors(), &out.payload));
    }
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
  impl->placement = placement;
  return GuardTorch("building stage", [&]() -> absl::StatusOr<std::unique_ptr<StageRuntime>> {
    impl->device = torch::Device(options.device);
    impl->layers = BuildLayers(job, placement.layer_begin, placement.layer_end);
    std::vector<torch::Tensor> parameters;
    for (auto& layer : impl->layers) {
      layer->to(impl->device);
      layer->train();
      for (const torch::Tensor& p : layer->parameters()) parameters.push_back(p);
    }
    const v1::Optimizer& opt = job.optimizer();
    if (opt.kind() == v1::Optimizer::KIND_SGD) {
      impl->optimizer = std::make_unique<torch::optim::SGD>(
          parameters, torch::optim::SGDOptions(opt.lr())
                          .momentum(opt.momentum())
                          .weight_decay(opt.weight_decay()));
    } else {
      impl->optimizer = std::make_unique<torch::optim::AdamW>(
          parameters, torch::optim::AdamWOptions(opt.lr())
                          .betas({opt.beta1(), opt.beta2()})
                          .weight_decay(opt.weight_decay()));
    }
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
  if (!impl_->dataset) return absl::FailedPreconditionError("not stage 0");
  const uint64_t microbatch =
      static_cast<uint64_t>(step) * impl_->job.microbatches() + index;
  return GuardTorch("loading data", [&]() -> absl::StatusOr<LinkMessage> {
    return impl_->FromBatch(impl_->dataset->TrainMicrobatch(microbatch),
                            v1::MESSAGE_KIND_ACTIVATION, step, microbatch);
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
    ASSIGN_OR_RETURN(torch::Tensor targets, s.Decode(input, 1));
    if (!train) {
      torch::NoGradGuard no_grad;
      return s.MakeMessage(input.header, v1::MESSAGE_KIND_EVAL, {s.RunLayers(x), targets});
    }
    if (s.pending.count(input.header.microbatch()) > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "microbatch ", input.header.microbatch(), " already in flight"));
    }
    if (!s.is_first()) x.requires_grad_(true);
    torch::Tensor y = s.RunLayers(x);
    s.pending[input.header.microbatch()] = {x, y};
    return s.MakeMessage(input.header, v1::MESSAGE_KIND_ACTIVATION, {y, targets});
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
  return GuardTorch("backward", [&]() -> absl::StatusOr<std::optional<LinkMessage>> {
    ASSIGN_OR_RETURN(torch::Tensor grad, s.Decode(gradient, 0));
    if (!grad.sizes().equals(pending.output.sizes())) {
      return absl::InvalidArgumentError("gradient shape differs from the activation");
    }
    torch::autograd::backward({pending.output}, {grad});
    if (s.is_first()) return std::optional<LinkMessage>();
    ASSIGN_OR_RETURN(LinkMessage up, s.MakeMessage(gradient.header, v1::MESSAGE_KIND_GRADIENT,
                                                   {pending.input.grad()}));
    return std::optional<LinkMessage>(std::move(up));
  });
}

absl::StatusOr<LastStageResult> StageRuntime::ForwardLoss(const LinkMessage& input) {
  Impl& s = *impl_;
  return GuardTorch("forward/backward", [&]() -> absl::StatusOr<LastStageResult> {
    ASSIGN_OR_RETURN(torch::Tensor x, s.Decode(input, 0));
    ASSIGN_OR_RETURN(torch::Tensor targets, s.Decode(input, 1));
    if (!s.is_first()) x.requires_grad_(true);
    torch::Tensor loss = ComputeLoss(s.job, s.RunLayers(x), targets);
    (loss / s.job.microbatches()).backward();
    LastStageResult result;
    result.loss = loss.item<double>();
    if (!s.is_first()) {
      ASSIGN_OR_RETURN(result.gradient, s.MakeMessage(input.header, v1::MESSAGE_KIND_GRADIENT,
                                                      {x.grad()}));
    }
    return result;
  });
}

absl::Status StageRuntime::EvalForward(const LinkMessage& input) {
  Impl& s = *impl_;
  return GuardTorch("eval", [&]() -> absl::Status {
    torch::NoGradGuard no_grad;
    ASSIGN_OR_RETURN(torch::Tensor x, s.Decode(input, 0));
    ASSIGN_OR_RETURN(torch::Tensor targets, s.Decode(input, 1));
    torch::Tensor output = s.RunLayers(x);
    const int64_t batch = targets.size(0);
    const int64_t elements = LossElements(s.job, batch);
    s.eval_loss_sum += ComputeLoss(s.job, output, targets).item<double>() * elements;
    s.eval_elements += elements;
    s.eval_samples += batch;
    const int64_t correct = CountCorrect(s.job, output, targets);
    if (correct >= 0) s.eval_correct += correct;
    return absl::OkStatus();
  });
}

EvalResult StageRuntime::TakeEvalResult() {
  Impl& s = *impl_;
  EvalResult result;
  result.samples = s.eval_samples;
  if (s.eval_elements > 0) result.loss = s.eval_loss_sum / s.eval_elements;
  if (s.job.has_mlp() && s.eval_samples > 0) {
    result.accuracy = static_cast<double>(s.eval_correct) / s.eval_samples;
  }
  s.eval_loss_sum = 0;
  s.eval_elements = s.eval_correct = s.eval_samples = 0;
  return result;
}

absl::Status StageRuntime::ApplyUpdate() {
  return GuardTorch("optimizer step", [&]() -> absl::Status {
    impl_->optimizer->step();
    impl_->optimizer->zero_grad();
    return absl::OkStatus();
  });
}

}  // namespace geotrain
