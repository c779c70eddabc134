#include "worker/weight_stash.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

std::vector<torch::Tensor> AsLeaves(std::vector<torch::Tensor> tensors) {
  for (torch::Tensor& t : tensors) t = t.detach().requires_grad_(true);
  return tensors;
}

}  // namespace

WeightStash::WeightStash(std::vector<torch::Tensor> initial) {
  versions_[0].tensors = AsLeaves(std::move(initial));
}

int64_t WeightStash::Acquire() {
  ++versions_[current_].references;
  return current_;
}

const std::vector<torch::Tensor>& WeightStash::Get(int64_t version) const {
  return versions_.at(version).tensors;
}

absl::Status WeightStash::Release(int64_t version) {
  auto it = versions_.find(version);
  if (it == versions_.end() || it->second.references <= 0) {
    return absl::InternalError(absl::StrCat("release of weight version ", version,
                                            " which holds no reference"));
  }
  if (--it->second.references == 0 && version != current_) versions_.erase(it);
  return absl::OkStatus();
}

void WeightStash::Publish(std::vector<torch::Tensor> next) {
  auto old = versions_.find(current_);
  ++current_;
  versions_[current_].tensors = AsLeaves(std::move(next));
  if (old != versions_.end() && old->second.references == 0) versions_.erase(old);
  max_alive_ = std::max(max_alive_, versions_.size());
}

int64_t WeightStash::VersionOf(const torch::Tensor& tensor) const {
  for (const auto& [number, version] : versions_) {
    for (const torch::Tensor& t : version.tensors) {
      if (t.unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl()) return number;
    }
  }
  return -1;
}

uint64_t WeightStash::bytes_alive() const {
  uint64_t bytes = 0;
  for (const auto& [number, version] : versions_) {
    for (const torch::Tensor& t : version.tensors) bytes += t.numel() * t.element_size();
  }
  return bytes;
}

int64_t WeightStash::references() const {
  int64_t total = 0;
  for (const auto& [number, version] : versions_) total += version.references;
  return total;
}

}  // namespace geotrain
