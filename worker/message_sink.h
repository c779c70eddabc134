// What the pipeline driver reads from its links (the Inbox) and sends
// through (a MessageSink): the seam between the driver and the links, so
// the driver and a worker session can be driven without sockets.
// A link end pushes each validated message to the Inbox, whose bound gives
// back-pressure: a full inbox stops the reader, so flow control (HTTP/2, or
// TCP through a relay) stalls the sender.
#ifndef GEOTRAIN_WORKER_MESSAGE_SINK_H_
#define GEOTRAIN_WORKER_MESSAGE_SINK_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/bounded_queue.h"
#include "common/link_message.h"
#include "worker/send_pacer.h"

namespace geotrain {

// Who is at a link's other end: a neighbour on the stage before or after,
// or a replica of this stage in another pipeline (the outer sync's links).
enum class PeerSide { kUpstream, kDownstream, kReplica };
inline const char* PeerSideName(PeerSide side) {  // "upstream", "downstream", "replica"
  switch (side) {
    case PeerSide::kUpstream: return "upstream";
    case PeerSide::kDownstream: return "downstream";
    case PeerSide::kReplica: return "replica";
  }
  return "?";
}

struct InboundMessage {
  bool from_upstream = false;
  LinkMessage message;
  absl::Status error;  // not OK: the link broke; `message` is empty
  // For LinkRateMeter: payload after the first frame, the time from the
  // first frame's arrival to the last's, and whether the reader waited on a
  // full inbox just before this message.
  uint64_t trailing_bytes = 0;
  absl::Duration dispersion;
  bool after_stall = false;
  std::string peer;  // worker id at the other end of the link, when known
  bool from_replica = false;  // an outer-sync link (from_upstream is false)
  // The epoch of the link it came on (an outer-sync link's may be later
  // than the session's): tells a link's last words from its successor's.
  uint64_t link_epoch = 0;
};
using Inbox = BoundedQueue<InboundMessage>;

// Where the pipeline driver sends a message. Thread-safe.
class MessageSink {
 public:
  virtual ~MessageSink() = default;
  // Takes the message: a link keeps it until its bytes are on the socket.
  virtual absl::Status Send(LinkMessage message) = 0;
  // The driver got the reply (gradient) to training microbatch
  // `microbatch`, sent through this sink. For routing; default: nothing.
  virtual void OnReply(uint64_t microbatch) {}
  // After a failed Send(): the worker id at the far end of the link that
  // failed, when this sink knows it ("" otherwise).
  virtual std::string failed_peer() const { return ""; }
  // The worker holding the oldest microbatch sent through this sink and
  // not yet answered, when this sink routes among several ("" otherwise).
  virtual std::string oldest_pending_peer() const { return ""; }
};

// One open link, as a worker session holds it: a sink toward one neighbour
// that the session ends on purpose (a re-plan, a failure elsewhere) or
// closes cleanly (the job is done). LinkEnd is the real one.
class PipelineLink : public MessageSink {
 public:
  virtual PeerSide side() const = 0;
  // Bulk links (the outer sync's) send their frames at `pacer`'s pace; the
  // pipeline's own links are not paced. The default ignores it.
  virtual void PaceSends(std::shared_ptr<SendPacer> pacer) {}
  // Ends the link at once; no error reaches the inbox. Blocked sends fail.
  virtual void EndOnPurpose() = 0;
  // Half-closes and waits up to `timeout` for the peer to end the link.
  virtual absl::Status Close(absl::Duration timeout) = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_MESSAGE_SINK_H_
