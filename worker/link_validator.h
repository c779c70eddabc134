// Decides whether a message that arrived on a link may be used: the plan
// epoch, the sender's stage, the kind for its direction, every tensor's
// shape, dtype, size and finiteness against what the plan implies, and a
// training message's commitment (common/commitment.h).
// Immutable after construction; thread-safe.
#ifndef GEOTRAIN_WORKER_LINK_VALIDATOR_H_
#define GEOTRAIN_WORKER_LINK_VALIDATOR_H_

#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "common/link_message.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

class LinkValidator {
 public:
  // `layer_begin`/`layer_end`: the receiving stage's layers.
  // `upstream_workers`: the ids of the workers the plan puts on the stage
  // before (one, or several with replicas); a HELLO must name one of them.
  // Empty: any sender id is accepted (tools and tests).
  // `replica_peers`: the workers of this stage in other pipelines that hold
  // an outer-sync link with this one (job.outer); a replica's HELLO must
  // name one of them. `replica_link_epochs`: the epoch of the outer link
  // with a replica whose pipeline was formed after this one's (the later of
  // the two, OuterLinkEpochOf); the others' links carry `epoch`.
  LinkValidator(const v1::JobSpec& job, uint64_t epoch, int stage,
                int layer_begin, int layer_end,
                std::set<std::string> upstream_workers = {},
                std::set<std::string> replica_peers = {},
                std::map<std::string, uint64_t> replica_link_epochs = {});

  // A message from the upstream neighbour (activations, eval, control).
  absl::Status CheckFromUpstream(const LinkMessage& message) const;
  // A message from the downstream neighbour (gradients).
  absl::Status CheckFromDownstream(const LinkMessage& message) const;
  // The header alone, at a message's first frame (FrameAssembler): epoch,
  // kind and every tensor's shape, dtype and sizes. CheckFrom* repeat it.
  absl::Status CheckHeaderFromUpstream(const v1::LinkHeader& header) const;
  absl::Status CheckHeaderFromDownstream(const v1::LinkHeader& header) const;
  // The HELLO that opens a stream from upstream. FAILED_PRECONDITION (try
  // again) for a newer plan epoch than this stage's: the dialler saw it
  // first. INVALID_ARGUMENT for anything else that does not match.
  absl::Status CheckHello(const v1::LinkHeader& hello) const;
  // The HELLO of a downstream worker that dials this one (the plan's
  // LINK_DIALER_DOWNSTREAM): from stage + 1, one of `dialling_downstream`,
  // addressed to `self_id`. Epochs as CheckHello.
  absl::Status CheckHelloFromDownstream(const v1::LinkHeader& hello,
                                        const std::set<std::string>& dialling_downstream,
                                        const std::string& self_id) const;

  // The HELLO of another replica of this stage opening an outer-sync link:
  // from this stage, one of `replica_peers`, addressed to `self_id`.
  absl::Status CheckHelloFromReplica(const v1::LinkHeader& hello,
                                     const std::string& self_id) const;
  // An outer-sync message (OUTER_DELTA, OUTER_MEAN): its header lists every
  // layer of this stage in order, each with the model's parameters, and
  // every tensor is float32 of its parameter's exact shape, so the payload
  // it announces is bounded by the stage's size before anything is kept.
  absl::Status CheckHeaderFromReplica(const v1::LinkHeader& header) const;
  absl::Status CheckFromReplica(const LinkMessage& message) const;
  // The validator of the outer-sync link with `peer` (one of
  // `replica_peers`): its messages and HELLOs carry the link's epoch.
  std::shared_ptr<const LinkValidator> ForReplicaLink(const std::string& peer) const;
  // The epoch of the outer-sync link with `peer`.
  uint64_t ReplicaLinkEpoch(const std::string& peer) const;

  uint64_t epoch() const { return epoch_; }
  int stage() const { return stage_; }

 private:
  absl::Status CheckEpoch(const v1::LinkHeader& header) const;
  absl::Status CheckHelloEpoch(const v1::LinkHeader& hello) const;

  v1::JobSpec job_;
  uint64_t epoch_;
  int stage_;
  int layer_begin_, layer_end_;
  std::set<std::string> upstream_workers_;
  std::set<std::string> replica_peers_;
  std::map<std::string, uint64_t> replica_link_epochs_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_VALIDATOR_H_
