// Deadlines, limits and credentials of every link of one worker: one
// options struct for LinkEnd, LinkService and OpenLink.
#ifndef GEOTRAIN_WORKER_LINK_OPTIONS_H_
#define GEOTRAIN_WORKER_LINK_OPTIONS_H_

#include <functional>
#include <map>
#include <string>

#include "absl/time/time.h"
#include "common/rpc_options.h"
#include "common/transport_security.h"

namespace geotrain {

// Deadlines, limits and credentials of every link of one worker.
struct LinkOptions {
  // mTLS: who is at the far end comes from its certificate (see
  // transport_security.h); plaintext when `transport.insecure`.
  TransportSecurity transport;
  // A stream must send its HELLO within this long.
  absl::Duration hello_timeout = absl::Seconds(5);
  // Streams still waiting for a HELLO, per peer identity (the certificate's,
  // or the source host's when insecure) and in all.
  int max_pending_per_peer = 4;
  int max_pending = 64;
  // A peer that stops reading: one frame (<= 1 MiB) that cannot be written
  // for this long ends the stream, as keepalive would end a silent one.
  absl::Duration write_stall_timeout = absl::Milliseconds(kKeepaliveTimeMs + kKeepaliveTimeoutMs);
  // How long a dialler waits for a peer that answers "not ready" (it has
  // not started the plan yet), and how long an end waits for its peer to
  // dial in or to reach the relay.
  absl::Duration connect_timeout = absl::Seconds(120);
  // A peer that cannot be reached at all is given up on after this long (as
  // an open link that went silent would be).
  absl::Duration unreachable_timeout = absl::Milliseconds(kKeepaliveTimeMs + kKeepaliveTimeoutMs);
  absl::Duration close_timeout = absl::Seconds(30);
  // Peer address (as the plan names it) -> address to dial instead, e.g. a
  // geotrain-linkem relay in front of that peer.
  std::map<std::string, std::string> routes;
  // A second link of a worker that already has a live one waits this long
  // for the first to end (a restarted peer's old link does, at once); then
  // it is refused: the first stays (see LinkService::Answer).
  absl::Duration duplicate_link_wait = absl::Seconds(5);
  // Told when a link is refused because its worker's link is already open:
  // that worker's key is in use twice (the coordinator logs it). May be
  // empty; called off every lock.
  std::function<void(const std::string& worker, const std::string& detail)> on_key_in_use_twice;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_OPTIONS_H_
