#include "worker/upstream_links.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace geotrain {

UpstreamLinks::~UpstreamLinks() {
  std::map<std::string, std::shared_ptr<LinkEnd>> links;
  {
    absl::MutexLock lock(&mu_);
    links.swap(links_);
  }
  for (auto& [worker, end] : links) end->EndOnPurpose();
  for (auto& [worker, end] : links) end->WaitServed(absl::InfiniteDuration());
}

absl::Status UpstreamLinks::AwaitNoLink(const std::string& worker, absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  auto gone = [this, &worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return links_.count(worker) == 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&gone), wait)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "key in use twice: worker '", worker.substr(0, 128),
        "' already has a live upstream link here (", links_[worker]->description(),
        "); the second one is refused"));
  }
  return absl::OkStatus();
}

absl::Status UpstreamLinks::Register(std::shared_ptr<LinkEnd> end, absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  const std::string worker = end->peer().id;
  if (auto old = links_.find(worker); old != links_.end()) {
    std::shared_ptr<LinkEnd> previous = old->second;
    auto old_gone = [this, &previous, &worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = links_.find(worker);
      return it == links_.end() || it->second != previous;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&old_gone), wait)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "key in use twice: worker '", worker.substr(0, 128),
          "' already has a live upstream link here (", previous->description(),
          "); the second one is refused"));
    }
  }
  links_[worker] = std::move(end);
  return absl::OkStatus();
}

void UpstreamLinks::Unregister(const LinkEnd* end) {
  std::shared_ptr<LinkEnd> released;  // dropped after the lock
  absl::MutexLock lock(&mu_);
  if (auto it = links_.find(end->peer().id); it != links_.end() && it->second.get() == end) {
    released = std::move(it->second);
    links_.erase(it);
  }
}

void UpstreamLinks::NoteOrigin(const v1::LinkHeader& forward, const std::string& worker) {
  absl::MutexLock lock(&mu_);
  if (forward.kind() != v1::MESSAGE_KIND_EVAL) {
    origin_[forward.microbatch()] = worker;
    return;
  }
  eval_origin_[forward.step()] = worker;
  if (eval_origin_.size() > kMaxEvalOrigins) eval_origin_.erase(eval_origin_.begin());
}

void UpstreamLinks::EndAll() {
  absl::MutexLock lock(&mu_);
  for (auto& [worker, end] : links_) end->EndOnPurpose();
  origin_.clear();
  eval_origin_.clear();
}

absl::Status UpstreamLinks::Send(LinkMessage message) {
  std::shared_ptr<LinkEnd> end;
  {
    absl::MutexLock lock(&mu_);
    std::string worker;
    if (message.header.kind() == v1::MESSAGE_KIND_EVAL_ACK) {
      auto origin = eval_origin_.find(message.header.step());
      if (origin == eval_origin_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "no upstream link delivered the evaluation of step ", message.header.step()));
      }
      worker = origin->second;
    } else {
      auto origin = origin_.find(message.header.microbatch());
      if (origin == origin_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "no upstream link delivered microbatch ", message.header.microbatch()));
      }
      worker = origin->second;
      origin_.erase(origin);
    }
    auto ready = [this, &worker]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return links_.count(worker) > 0;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), connect_wait_);
    auto it = links_.find(worker);
    if (it == links_.end()) {
      failed_peer_ = worker;
      return absl::UnavailableError(
          absl::StrCat("no upstream link to '", worker, "' to send to"));
    }
    end = it->second;
  }
  absl::Status sent = end->Send(std::move(message));
  if (!sent.ok()) {
    absl::MutexLock lock(&mu_);
    failed_peer_ = end->peer().id;
  }
  return sent;
}

std::string UpstreamLinks::failed_peer() const {
  absl::MutexLock lock(&mu_);
  return failed_peer_;
}

}  // namespace geotrain
