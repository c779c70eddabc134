// Versioned parameters of one stage (PipeDream weight stashing).
//
// Each version is an immutable list of leaf tensors. A forward Acquire()s the
// current version and keeps it alive until its backward Release()s it; an
// optimizer update Publish()es a new version built out of place, so no live
// autograd graph ever sees its weights change. A version is freed when it is
// neither current nor referenced. Not thread-safe (the stage's thread only).
#ifndef GEOTRAIN_WORKER_WEIGHT_STASH_H_
#define GEOTRAIN_WORKER_WEIGHT_STASH_H_

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"

namespace geotrain {

class WeightStash {
 public:
  // Version 0 is `initial` (made leaves that require grad).
  explicit WeightStash(std::vector<torch::Tensor> initial);

  int64_t current_version() const { return current_; }
  // Takes a reference on the current version and returns its number.
  int64_t Acquire();
  // REQUIRES: `version` is alive.
  const std::vector<torch::Tensor>& Get(int64_t version) const;
  bool alive(int64_t version) const { return versions_.count(version) > 0; }
  // Drops one reference; frees the version if it is unreferenced and old.
  absl::Status Release(int64_t version);
  // Makes `next` the current version (its number is current + 1).
  void Publish(std::vector<torch::Tensor> next);
  // The version whose tensors include `tensor` (by identity), or -1.
  int64_t VersionOf(const torch::Tensor& tensor) const;

  size_t versions_alive() const { return versions_.size(); }
  size_t max_versions_alive() const { return max_alive_; }
  uint64_t bytes_alive() const;
  int64_t references() const;

 private:
  struct Version {
    std::vector<torch::Tensor> tensors;
    int64_t references = 0;
  };
  std::map<int64_t, Version> versions_;
  int64_t current_ = 0;
  size_t max_alive_ = 1;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_WEIGHT_STASH_H_
