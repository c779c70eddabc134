// Links between neighbouring stages, whichever end dials.
//
// The plan says, per pair of neighbouring workers, who opens the link
// (PlannedLink): the upstream worker dials the downstream one when that is
// reachable; a downstream worker behind NAT dials its upstream neighbour;
// two unreachable workers both dial a geotrain-relay, which splices them.
// Once open every link is the same: a LinkEnd on each side over a
// LinkTransport (link_transport.h), carrying activations down and
// gradients up. Each end reassembles frames, validates each message
// (LinkValidator) and pushes it to the worker's Inbox, whose bound gives
// back-pressure: a full inbox stops the reader, so flow control (HTTP/2,
// or TCP through a relay) stalls the sender.
//
// - LinkService: the Stage service. Accepts Link streams from either
//   neighbour (the HELLO's stage says which), bounded in number and time
//   before their HELLO, and answers reachability probes.
// - DialLink: opens the link this worker dials, direct or via a relay.
// - UpstreamLinks: the MessageSink for gradients: each goes back on the
//   link its activation came on (the worker that ran the forward holds its
//   stashed weights).
//
// Threading: gRPC's sync API. Each link has one reader (the service's
// handler thread for a stream a peer dialled, else a thread of the
// LinkEnd's own) and writes come from the pipeline driver through
// MessageSink::Send, one at a time per link. See docs/threading.md.
#ifndef GEOTRAIN_WORKER_LINK_STREAM_H_
#define GEOTRAIN_WORKER_LINK_STREAM_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/bounded_queue.h"
#include "common/link_message.h"
#include "common/rpc_options.h"
#include "common/transport_security.h"
#include "geotrain/v1/coordinator.pb.h"
#include "geotrain/v1/stage.grpc.pb.h"
#include "worker/link_transport.h"
#include "worker/link_validator.h"

namespace geotrain {

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

enum class PeerSide { kUpstream, kDownstream };
const char* PeerSideName(PeerSide side);  // "upstream", "downstream"

// One end of an open link (after the HELLOs). Thread-safe.
class LinkEnd final : public MessageSink, public std::enable_shared_from_this<LinkEnd> {
 public:
  struct Peer {
    std::string id;       // worker id at the far end
    std::string address;  // as the plan names it
    PeerSide side = PeerSide::kDownstream;
  };
  LinkEnd(std::unique_ptr<LinkTransport> transport, Peer peer, bool dialled,
          std::shared_ptr<const LinkValidator> validator, std::shared_ptr<Inbox> inbox,
          absl::Duration write_stall_timeout);
  // Cancels the link if it is still open. A reader thread (StartReader)
  // holds its own reference, so the end outlives it.
  ~LinkEnd() override;

  absl::Status Send(LinkMessage message) override;
  std::string failed_peer() const override { return peer_.id; }
  std::string oldest_pending_peer() const override { return peer_.id; }

  // Before serving: `on_forward` sees the header of each training or
  // evaluation activation before it is delivered; `on_end` runs when
  // Serve() ends.
  void SetHooks(std::function<void(const v1::LinkHeader&)> on_forward,
                std::function<void()> on_end);
  // Reads until the link ends, in the calling thread, delivering to the
  // inbox. A link that breaks (not ended by this side or cleanly closed by
  // the peer) pushes an error for the driver. After it returns nothing
  // touches the transport again. Returns why it ended (INVALID_ARGUMENT: a
  // message was refused).
  absl::Status Serve();
  // Serve() on a thread of its own, which keeps the end alive until Serve()
  // returns. REQUIRES: the end is owned by a shared_ptr.
  void StartReader();
  // Ends the link on purpose (a re-plan, a replacement, shutdown): no error
  // is pushed. Blocked sends fail.
  void EndOnPurpose();
  // Half-closes and waits up to `timeout` for the peer to end the link.
  absl::Status Close(absl::Duration timeout);
  // Waits up to `timeout` for Serve() to return; true at once when it
  // never started.
  bool WaitServed(absl::Duration timeout) const;

  const Peer& peer() const { return peer_; }
  bool dialled() const { return dialled_; }
  std::string description() const { return description_; }

 private:
  void CancelTransport();

  std::unique_ptr<LinkTransport> transport_;
  const Peer peer_;
  const bool dialled_;
  const std::string description_;
  const std::shared_ptr<const LinkValidator> validator_;
  const std::shared_ptr<Inbox> inbox_;
  const absl::Duration write_stall_timeout_;
  std::function<void(const v1::LinkHeader&)> on_forward_;
  std::function<void()> on_end_;
  std::atomic<bool> serving_{false};
  std::atomic<bool> on_purpose_{false};
  std::atomic<bool> closing_{false};
  absl::Notification served_;
  // write_mu_ serialises writes (a blocked write holds it; the stall
  // watchdog or a Cancel unblocks it). cancel_mu_ guards cancelling against
  // retirement. Order: write_mu_ before cancel_mu_.
  absl::Mutex write_mu_;
  absl::Mutex cancel_mu_;
  // Serve() returned: the transport is not used again (a borrowed gRPC
  // stream is gone with its handler).
  bool retired_ = false;  // written under both mutexes
};

// The links from the stage upstream, by worker. Thread-safe.
class UpstreamLinks final : public MessageSink {
 public:
  UpstreamLinks() = default;
  // Ends every link and waits for their readers (whose last act is
  // Unregister) before the table goes.
  ~UpstreamLinks() override;
  // Makes `end` the link to its worker. An older link of the same worker
  // is never displaced: `end` waits up to `wait` for it to end by itself (a
  // restarted peer's dead link does), and is refused with ALREADY_EXISTS
  // when it has not: a second holder of a worker's key cannot cut the
  // real link.
  absl::Status Register(std::shared_ptr<LinkEnd> end, absl::Duration wait);
  // Waits up to `wait` until `worker` has no link here: ALREADY_EXISTS
  // (key in use twice) when it still has one. A new link checks this before
  // it is answered, so a second holder of a key never gets an answer.
  absl::Status AwaitNoLink(const std::string& worker, absl::Duration wait);
  // After `end`'s Serve() returned.
  void Unregister(const LinkEnd* end);
  // `worker` delivered the activation of `forward` (a training microbatch,
  // or an evaluation pass's microbatch): its gradient (or EVAL_ACK) goes
  // back there.
  void NoteOrigin(const v1::LinkHeader& forward, const std::string& worker);
  // Ends every link on purpose and forgets the origins.
  void EndAll();

  // Sends a gradient to the upstream worker that delivered its microbatch
  // (an EVAL_ACK to the one that delivered its pass), waiting up to
  // `connect_wait` for that worker's link when it is reconnecting.
  // UNAVAILABLE when there is none or it broke; FAILED_PRECONDITION for a
  // microbatch (or pass) no upstream delivered.
  absl::Status Send(LinkMessage message) override;
  std::string failed_peer() const override;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<LinkEnd>> links_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::string> origin_ ABSL_GUARDED_BY(mu_);
  // Evaluation passes (by step) -> the worker that sent them; one worker
  // sends a whole pass. The newest kMaxEvalOrigins are kept: a pass's last
  // acknowledgements may come after the next pass began.
  static constexpr size_t kMaxEvalOrigins = 4;
  std::map<int, std::string> eval_origin_ ABSL_GUARDED_BY(mu_);
  std::string failed_peer_ ABSL_GUARDED_BY(mu_);
  absl::Duration connect_wait_ = absl::Seconds(2);
};

// The Stage service: accepts Link streams for the active plan and answers
// probes. Until Activate() every stream is refused with FAILED_PRECONDITION.
// A stream from upstream (HELLO from stage - 1, a worker the plan puts
// there) joins UpstreamLinks; one from downstream (stage + 1, a worker the
// plan says dials this one) waits for AwaitDownstream(). Malformed or
// inconsistent messages end that stream with INVALID_ARGUMENT; the worker
// keeps running. With TLS a HELLO must come from the worker its certificate
// names (PERMISSION_DENIED otherwise); streams without a HELLO are bounded
// in number and time (LinkOptions).
class LinkService final : public v1::Stage::Service {
 public:
  explicit LinkService(LinkOptions options);
  // Shuts down and waits for the readers of every link it accepted.
  ~LinkService() override;

  void SetWorkerId(const std::string& id);
  // The identities the coordinator has revoked (Plan.revoked_workers): their
  // calls are refused UNAUTHENTICATED, links and probes alike.
  void SetRevoked(std::set<std::string> revoked);
  // Accepts links for `validator`'s plan epoch, delivering to `inbox`
  // (shared: a stream of an older epoch may still be finishing).
  // `dialling_downstream`: the next stage's workers that dial this one.
  void Activate(std::shared_ptr<const LinkValidator> validator, std::shared_ptr<Inbox> inbox,
                std::set<std::string> dialling_downstream);
  // Ends every accepted link and refuses new ones until the next Activate.
  void Deactivate();
  void Shutdown();
  UpstreamLinks* upstream_links() { return &upstream_links_; }

  // Reads the HELLO on a transport a peer opened (a gRPC stream, or a link
  // a relay spliced) under the pending-stream limits, checks it against the
  // plan, answers it and registers the link. `identity`: the peer's
  // certified worker id ("" when insecure). The caller then runs Serve().
  absl::StatusOr<std::shared_ptr<LinkEnd>> Answer(std::unique_ptr<LinkTransport> transport,
                                                  const std::string& identity,
                                                  const std::string& peer_name);
  // The link the downstream worker `id` dialled for the active plan, waiting
  // up to `timeout` (UNAVAILABLE then) or until `*stop`.
  absl::StatusOr<std::shared_ptr<LinkEnd>> AwaitDownstream(const std::string& id,
                                                           absl::Duration timeout,
                                                           const std::atomic<bool>* stop);

  // The Link method, on raw frames (link_transport.h): registered in place
  // of the generated LinkFrame handler.
  grpc::Status LinkRaw(grpc::ServerContext* context, RawLinkStream* stream);
  grpc::Status Probe(grpc::ServerContext* context, const v1::ProbeRequest* request,
                     v1::ProbeResponse* response) override;
  // Echoes a payload's size (network measurement, common/stage_probe.h);
  // INVALID_ARGUMENT over kMaxMeasurePayloadBytes.
  grpc::Status Measure(grpc::ServerContext* context, const v1::MeasureRequest* request,
                       v1::MeasureResponse* response) override;

 private:
  absl::Status ReadHello(LinkTransport* transport, const std::string& pending_key,
                         const std::string& peer_name, FrameParts* hello);

  const LinkOptions options_;
  UpstreamLinks upstream_links_;
  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> revoked_ ABSL_GUARDED_BY(mu_);
  // UNAUTHENTICATED for a revoked identity ("" or insecure: OK).
  absl::Status CheckNotRevoked(const std::string& identity) const;
  std::shared_ptr<const LinkValidator> validator_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Inbox> inbox_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> dialling_downstream_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<LinkEnd>> downstream_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, int> pending_hellos_ ABSL_GUARDED_BY(mu_);
  int pending_total_ ABSL_GUARDED_BY(mu_) = 0;
};

// What this worker knows about a link it opens.
struct DialTarget {
  std::string self_id;
  int self_stage = 0;
  LinkEnd::Peer peer;
  const v1::PlannedLink* planned = nullptr;  // null: direct, upstream dials
};

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
// `to_worker` (also the answer, without workers).
v1::LinkHeader MakeHello(uint64_t epoch, int from_stage, const std::string& from_worker = "",
                         const std::string& to_worker = "");

// "GTRELAY1 <rendezvous> <up|down>": what a link end says to a relay first.
inline constexpr char kRelayGreeting[] = "GTRELAY1";

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_STREAM_H_
