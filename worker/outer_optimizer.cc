#include "worker/outer_optimizer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

torch::Tensor CpuFloatCopy(const torch::Tensor& t) {
  return t.detach().to(torch::kCPU, torch::kFloat32).contiguous().clone();
}

}  // namespace

OuterOptimizer::OuterOptimizer(OuterStepOptions options) : options_(options) {}

void OuterOptimizer::Reset(const std::vector<torch::Tensor>& params) {
  outer_.clear();
  for (const torch::Tensor& p : params) outer_.push_back(CpuFloatCopy(p));
  momentum_.clear();
  rounds_ = 0;
}

absl::Status OuterOptimizer::CheckFits(const std::vector<torch::Tensor>& tensors,
                                       const char* what) const {
  if (tensors.size() != outer_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", tensors.size(),
                                                   " tensors for ", outer_.size(),
                                                   " parameters"));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].sizes().equals(outer_[i].sizes())) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": tensor ", i, " has the wrong shape"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<torch::Tensor>> OuterOptimizer::PseudoGradient(
    const std::vector<torch::Tensor>& params) const {
  if (!started()) return absl::FailedPreconditionError("no outer weights yet");
  if (absl::Status fits = CheckFits(params, "pseudo-gradient"); !fits.ok()) return fits;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> delta;
  delta.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    delta.push_back(outer_[i] - params[i].detach().to(torch::kCPU, torch::kFloat32));
  }
  return delta;
}

absl::StatusOr<std::vector<torch::Tensor>> OuterOptimizer::Step(
    std::vector<PseudoGradientContribution> contributions) {
  absl::StatusOr<std::vector<torch::Tensor>> mean = Mean(std::move(contributions));
  if (!mean.ok()) return mean.status();
  if (mean->empty()) return outer_;
  return StepWithMean(*mean);
}

absl::StatusOr<std::vector<torch::Tensor>> OuterOptimizer::Mean(
    std::vector<PseudoGradientContribution> contributions) const {
  if (!started()) return absl::FailedPreconditionError("no outer weights yet");
  torch::NoGradGuard no_grad;
  std::sort(contributions.begin(), contributions.end(),
            [](const auto& a, const auto& b) { return a.pipeline < b.pipeline; });
  int64_t total = 0;
  for (const PseudoGradientContribution& c : contributions) {
    if (c.samples < 0) return absl::InvalidArgumentError("a contribution has negative samples");
    if (c.samples == 0) continue;
    if (absl::Status fits = CheckFits(c.tensors, "pseudo-gradient"); !fits.ok()) return fits;
    for (const torch::Tensor& t : c.tensors) {
      if (!torch::isfinite(t).all().item<bool>()) {
        return absl::InvalidArgumentError(
            absl::StrCat("the pseudo-gradient of pipeline ", c.pipeline, " is not finite"));
      }
    }
    total += c.samples;
  }
  std::vector<torch::Tensor> mean;
  if (total == 0) return mean;
  for (size_t i = 0; i < outer_.size(); ++i) {
    torch::Tensor sum = torch::zeros_like(outer_[i]);
    for (const PseudoGradientContribution& c : contributions) {
      if (c.samples == 0) continue;
      sum.add_(c.tensors[i].to(torch::kCPU, torch::kFloat32),
               static_cast<double>(c.samples) / static_cast<double>(total));
    }
    mean.push_back(std::move(sum));
  }
  return mean;
}

absl::StatusOr<std::vector<torch::Tensor>> OuterOptimizer::StepWithMean(
    const std::vector<torch::Tensor>& mean) {
  if (!started()) return absl::FailedPreconditionError("no outer weights yet");
  if (absl::Status fits = CheckFits(mean, "mean pseudo-gradient"); !fits.ok()) return fits;
  torch::NoGradGuard no_grad;
  for (const torch::Tensor& t : mean) {
    if (!torch::isfinite(t).all().item<bool>()) {
      return absl::InvalidArgumentError("the mean pseudo-gradient is not finite");
    }
  }
  const bool first = momentum_.empty();
  for (size_t i = 0; i < outer_.size(); ++i) {
    const torch::Tensor m = mean[i].to(torch::kCPU, torch::kFloat32);
    torch::Tensor update = m;
    if (options_.momentum != 0) {
      if (first) {
        momentum_.push_back(m.clone());
      } else {
        momentum_[i].mul_(options_.momentum).add_(m);
      }
      update = options_.nesterov ? m.add(momentum_[i], options_.momentum) : momentum_[i];
    }
    outer_[i].add_(update, -options_.lr);
  }
  ++rounds_;
  return outer_;
}

absl::Status OuterOptimizer::Restore(const std::vector<torch::Tensor>& outer,
                                     const std::vector<torch::Tensor>& momentum,
                                     int64_t rounds) {
  if (!started()) return absl::FailedPreconditionError("no outer weights to restore into");
  if (absl::Status fits = CheckFits(outer, "outer weights"); !fits.ok()) return fits;
  if (!momentum.empty()) {
    if (absl::Status fits = CheckFits(momentum, "outer momentum"); !fits.ok()) return fits;
  }
  outer_.clear();
  for (const torch::Tensor& t : outer) outer_.push_back(CpuFloatCopy(t));
  momentum_.clear();
  for (const torch::Tensor& t : momentum) momentum_.push_back(CpuFloatCopy(t));
  rounds_ = rounds;
  return absl::OkStatus();
}

absl::Status ErrorFeedbackEncoder::Encode(size_t index, const torch::Tensor& tensor,
                                          v1::TensorHeader* header, std::string* payload) {
  torch::NoGradGuard no_grad;
  const bool lossy =
      encoding_.codec != v1::CODEC_NONE && encoding_.codec != v1::CODEC_UNSPECIFIED;
  if (!lossy) return EncodeTensor(CpuFloatCopy(tensor), header, payload, encoding_);
  if (residual_.size() <= index) residual_.resize(index + 1);
  torch::Tensor value = CpuFloatCopy(tensor);
  if (residual_[index].defined()) value.add_(residual_[index]);
  const size_t offset = payload->size();
  if (absl::Status encoded = EncodeTensor(value, header, payload, encoding_); !encoded.ok()) {
    return encoded;
  }
  absl::StatusOr<torch::Tensor> sent = DecodeTensor(*header, *payload, offset);
  if (!sent.ok()) return sent.status();
  residual_[index] = value - *sent;
  return absl::OkStatus();
}

torch::Tensor ErrorFeedbackEncoder::residual(size_t index) const {
  return index < residual_.size() ? residual_[index] : torch::Tensor();
}

}  // namespace geotrain
