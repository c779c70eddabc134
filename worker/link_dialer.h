// Opens the links this worker dials (the plan's PlannedLink says who
// dials): direct, as a gRPC stream to the peer, or through a
// geotrain-relay that splices two ends which cannot be reached.
#ifndef GEOTRAIN_WORKER_LINK_DIALER_H_
#define GEOTRAIN_WORKER_LINK_DIALER_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "geotrain/v1/coordinator.pb.h"
#include "worker/link_end.h"
#include "worker/link_options.h"
#include "worker/link_service.h"
#include "worker/link_validator.h"
#include "worker/message_sink.h"

namespace geotrain {

// What this worker knows about a link it opens.
struct DialTarget {
  std::string self_id;
  int self_stage = 0;
  LinkEnd::Peer peer;
  const v1::PlannedLink* planned = nullptr;  // null: direct, upstream dials
};

// Whether this worker plays the planned link's upstream end: the end that
// opens the TLS session through a relay and speaks first. The upstream
// neighbour on a pipeline link; the contributing replica (not the
// reducer) on an outer-sync link.
bool PlaysUpstreamEnd(const DialTarget& target);

// Opens the link to `target.peer` that the plan says this worker opens:
// direct (a gRPC stream to the peer's address, or its route), retrying
// while the peer has not yet started the plan (up to connect_timeout) or
// cannot be reached (up to unreachable_timeout); or through the plan's
// relay, where the upstream end opens the TLS session and sends the HELLO
// and the downstream end answers it through `service` (which registers it).
// The returned end's reader is running. Errors say which address, which
// direction and what to check.
absl::StatusOr<std::shared_ptr<LinkEnd>> OpenLink(
    const DialTarget& target, std::shared_ptr<const LinkValidator> validator,
    std::shared_ptr<Inbox> inbox, const LinkOptions& options, LinkService* service,
    const std::atomic<bool>* stop);

// HELLO header for worker `from_worker` on `from_stage` opening a link to

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_DIALER_H_
