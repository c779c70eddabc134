// The outer sync's parts that touch the rest of the worker: its messages
// as link messages (OUTER_DELTA, OUTER_MEAN on a replica link, checked by
// LinkValidator::CheckFromReplica), the links they travel on, and the
// stage runtime as the outer optimizer. The protocol itself is
// OuterSync (outer_sync.h).
#ifndef GEOTRAIN_WORKER_OUTER_LINKS_H_
#define GEOTRAIN_WORKER_OUTER_LINKS_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/link_message.h"
#include "worker/message_sink.h"
#include "worker/outer_sync.h"
#include "worker/stage_runtime.h"

namespace geotrain {

// An outer message as a link message: the layers' parameters become the
// message's tensors, in order, and LinkHeader.outer says which layer each
// belongs to.
LinkMessage ToLinkMessage(const OuterMessage& message, int stage);
// The reverse, for a message the validator passed (its layers and tensor
// sizes are already checked against the stage). INVALID_ARGUMENT for one
// whose sizes do not add up.
absl::StatusOr<OuterMessage> FromLinkMessage(const LinkMessage& message);

// Sends outer messages on the session's replica links from a thread of its
// own, so a pseudo-gradient crossing a slow link overlaps the next inner
// steps instead of stalling them. Messages to one peer go in order; a
// failed send is logged (the link's reader reports the broken link to the
// driver). Thread-safe.
class OuterLinks final : public OuterTransport {
 public:
  // `links`: by the pipeline of the replica at the other end. Not owned
  // beyond the shared pointers.
  // `pacer` (may be null: unpaced) paces every link's frames, these and
  // the ones attached later: the outer sync's transfers share the uplink
  // with the pipeline's links.
  OuterLinks(std::map<int, std::shared_ptr<PipelineLink>> links, int stage,
             std::shared_ptr<SendPacer> pacer = nullptr);
  // Stops sending; messages still queued are dropped.
  ~OuterLinks() override;

  absl::Status Send(int to, OuterMessage message) override;
  // Waits until every queued message is on its link (or failed).
  void Flush();
  // A re-plan the session goes on through: the link to `pipeline`'s replica
  // leaves (returned; messages still queued for it are dropped), or a new
  // one takes its place.
  std::shared_ptr<PipelineLink> Remove(int pipeline);
  void Attach(int pipeline, std::shared_ptr<PipelineLink> link);
  uint64_t bytes_sent() const override;

 private:
  void SendLoop();

  std::map<int, std::shared_ptr<PipelineLink>> links_ ABSL_GUARDED_BY(mu_);
  const int stage_;
  const std::shared_ptr<SendPacer> pacer_;
  mutable absl::Mutex mu_;
  std::deque<std::pair<int, OuterMessage>> queue_ ABSL_GUARDED_BY(mu_);
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t bytes_sent_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread sender_;
};

// The stage runtime's outer optimizer (StageRuntime::StartOuter'ed) behind
// OuterCompute. Not owned; the driver's thread calls it.
class RuntimeOuterCompute final : public OuterCompute {
 public:
  explicit RuntimeOuterCompute(StageRuntime* runtime) : runtime_(runtime) {}
  absl::StatusOr<std::vector<v1::LayerWeights>> ExportPseudoGradient() override {
    return runtime_->ExportPseudoGradient();
  }
  absl::StatusOr<std::vector<v1::LayerWeights>> Reduce(
      const std::vector<Contribution>& contributions) override;
  absl::Status ApplyMean(const std::vector<v1::LayerWeights>& mean,
                         bool keep_local_progress) override {
    return runtime_->ApplyOuterMean(mean, keep_local_progress);
  }
  absl::StatusOr<std::vector<v1::LayerWeights>> ExportState() override;
  absl::Status AdoptState(const std::vector<v1::LayerWeights>& state, int64_t rounds) override;
  int64_t rounds() const override { return runtime_->outer_rounds(); }

 private:
  StageRuntime* const runtime_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_OUTER_LINKS_H_
