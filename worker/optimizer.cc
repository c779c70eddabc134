#include "worker/optimizer.h"

#include <algorithm>
#include <cmath>

namespace geotrain {
namespace {

class AdamW : public OutOfPlaceOptimizer {
 public:
  explicit AdamW(const v1::Optimizer& spec) : spec_(spec) {}

  std::vector<torch::Tensor> Step(const std::vector<torch::Tensor>& params,
                                  const std::vector<torch::Tensor>& grads,
                                  double lr_scale) override {
    torch::NoGradGuard no_grad;
    if (m_.empty()) {
      for (const torch::Tensor& p : params) {
        m_.push_back(torch::zeros_like(p));
        v_.push_back(torch::zeros_like(p));
      }
    }
    ++t_;
    const double lr = spec_.lr() * lr_scale, b1 = spec_.beta1(), b2 = spec_.beta2();
    const double correction1 = 1 - std::pow(b1, t_);
    const double correction2 = 1 - std::pow(b2, t_);
    std::vector<torch::Tensor> next;
    next.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      // Tensors State() handed out and someone still holds (a spot check's
      // kept version) are left as they are: the step writes new ones.
      // Unshared, it updates in place, without the allocations.
      if (m_[i].use_count() > 1) {
        m_[i] = m_[i].lerp(grads[i], 1 - b1);
      } else {
        m_[i].lerp_(grads[i], 1 - b1);
      }
      if (v_[i].use_count() > 1) {
        v_[i] = v_[i].mul(b2).addcmul_(grads[i], grads[i], 1 - b2);
      } else {
        v_[i].mul_(b2).addcmul_(grads[i], grads[i], 1 - b2);
      }
      // sqrt(v / c2) + eps = (sqrt(v) + eps * sqrt(c2)) / sqrt(c2).
      torch::Tensor denom = v_[i].sqrt().add_(kEps * std::sqrt(correction2));
      torch::Tensor p = params[i].detach().mul(1 - lr * spec_.weight_decay());
      next.push_back(p.addcdiv_(m_[i], denom, -lr * std::sqrt(correction2) / correction1));
    }
    return next;
  }

  std::vector<std::vector<torch::Tensor>> State() const override {
    std::vector<std::vector<torch::Tensor>> state;
    for (size_t i = 0; i < m_.size(); ++i) state.push_back({m_[i], v_[i]});
    return state;
  }
  int64_t steps() const override { return t_; }
  absl::Status Restore(const std::vector<std::vector<torch::Tensor>>& state,
                       int64_t steps) override {
    std::vector<torch::Tensor> m, v;
    for (const auto& per_param : state) {
      if (per_param.size() != 2) {
        return absl::InvalidArgumentError("AdamW keeps two state tensors per parameter");
      }
      m.push_back(per_param[0].detach().clone());
      v.push_back(per_param[1].detach().clone());
    }
    m_ = std::move(m);
    v_ = std::move(v);
    t_ = steps;
    return absl::OkStatus();
  }

 private:
  static constexpr double kEps = 1e-8;
  v1::Optimizer spec_;
  std::vector<torch::Tensor> m_, v_;
  int64_t t_ = 0;
};

class Sgd : public OutOfPlaceOptimizer {
 public:
  explicit Sgd(const v1::Optimizer& spec) : spec_(spec) {}

  std::vector<torch::Tensor> Step(const std::vector<torch::Tensor>& params,
                                  const std::vector<torch::Tensor>& grads,
                                  double lr_scale) override {
    torch::NoGradGuard no_grad;
    const double lr = spec_.lr() * lr_scale;
    std::vector<torch::Tensor> next;
    for (size_t i = 0; i < params.size(); ++i) {
      torch::Tensor g = grads[i] + spec_.weight_decay() * params[i].detach();
      if (spec_.momentum() > 0) {
        if (buffers_.size() <= i) {
          buffers_.push_back(g.clone());
        } else {
          if (buffers_[i].use_count() > 1) {  // held (see AdamW)
            buffers_[i] = buffers_[i].mul(spec_.momentum()).add_(g);
          } else {
            buffers_[i].mul_(spec_.momentum()).add_(g);
          }
        }
        g = buffers_[i];
      }
      next.push_back(params[i].detach() - lr * g);
    }
    ++steps_;
    return next;
  }

  std::vector<std::vector<torch::Tensor>> State() const override {
    std::vector<std::vector<torch::Tensor>> state;
    for (const torch::Tensor& b : buffers_) state.push_back({b});
    return state;
  }
  int64_t steps() const override { return steps_; }
  absl::Status Restore(const std::vector<std::vector<torch::Tensor>>& state,
                       int64_t steps) override {
    std::vector<torch::Tensor> buffers;
    for (const auto& per_param : state) {
      if (per_param.size() != 1) {
        return absl::InvalidArgumentError("SGD keeps one state tensor per parameter");
      }
      buffers.push_back(per_param[0].detach().clone());
    }
    buffers_ = std::move(buffers);
    steps_ = steps;
    return absl::OkStatus();
  }

 private:
  int64_t steps_ = 0;
  v1::Optimizer spec_;
  std::vector<torch::Tensor> buffers_;
};

}  // namespace

std::unique_ptr<OutOfPlaceOptimizer> MakeOptimizer(const v1::Optimizer& spec) {
  if (spec.kind() == v1::Optimizer::KIND_SGD) return std::make_unique<Sgd>(spec);
  return std::make_unique<AdamW>(spec);
}

}  // namespace geotrain
