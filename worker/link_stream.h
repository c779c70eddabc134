// The two ends of a Link stream between neighbouring stages.
//
// The upstream worker dials (DownstreamLinkClient); the downstream worker
// serves (UpstreamLinkServer, the Stage service). Either end reassembles
// frames, validates each message (LinkValidator) and pushes it to the
// worker's Inbox, whose bound gives back-pressure: a full inbox stops the
// reader, so HTTP/2 flow control stalls the sender.
//
// Threading: gRPC's sync API; each stream has one reader thread (the
// server's handler thread, or the client's own reader) and writes come from
// the pipeline driver thread through MessageSink::Send, one at a time under
// a mutex. See docs/threading.md.
#ifndef GEOTRAIN_WORKER_LINK_STREAM_H_
#define GEOTRAIN_WORKER_LINK_STREAM_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/bounded_queue.h"
#include "common/link_message.h"
#include "common/rpc_options.h"
#include "common/transport_security.h"
#include "geotrain/v1/stage.grpc.pb.h"
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
  virtual absl::Status Send(const LinkMessage& message) = 0;
  // The driver got the reply (gradient) to training microbatch
  // `microbatch`, sent through this sink. For routing; default: nothing.
  virtual void OnReply(uint64_t microbatch) {}
  // After a failed Send(): the worker id at the far end of the link that
  // failed, when this sink knows it ("" otherwise).
  virtual std::string failed_peer() const { return ""; }
};

struct LinkSecurityOptions {
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
};

// Serves Link streams from the upstream stage. Until Activate() every stream
// is refused with FAILED_PRECONDITION; afterwards one stream per upstream
// worker (several when that stage has replicas) is accepted if its HELLO
// matches the plan; a new stream from the same worker replaces its old one.
// Malformed or inconsistent messages end that stream with INVALID_ARGUMENT;
// the worker keeps running. With TLS a HELLO must come from the worker its
// certificate names (PERMISSION_DENIED otherwise); streams without a HELLO
// are bounded in number and time (LinkSecurityOptions).
//
// Each training activation's microbatch is remembered with the worker it
// came from, and Send() returns the microbatch's gradient on that worker's
// stream: the worker that ran the forward holds its stashed weights.
class UpstreamLinkServer final : public v1::Stage::Service, public MessageSink {
 public:
  explicit UpstreamLinkServer(LinkSecurityOptions security = LinkSecurityOptions())
      : security_(std::move(security)) {}

  // Accepts streams for `validator`'s plan epoch, delivering to `inbox`
  // (shared: a stream of an older epoch may still be finishing).
  void Activate(std::shared_ptr<const LinkValidator> validator, std::shared_ptr<Inbox> inbox);
  // Ends the active stream, if any, and refuses new ones (as before the
  // first Activate) until the next Activate: the plan changed.
  void Deactivate();

  grpc::Status Link(grpc::ServerContext* context,
                    grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream)
      override;

  // Sends a gradient to the upstream worker that delivered its microbatch,
  // waiting up to `connect_wait` for that worker's stream when it is
  // reconnecting. UNAVAILABLE when there is none or it broke;
  // FAILED_PRECONDITION for a microbatch no upstream delivered.
  absl::Status Send(const LinkMessage& message) override;
  std::string failed_peer() const override;

  // Cancels the active streams, if any.
  void Shutdown();

 private:
  // One accepted stream. Its handler owns it; `upstreams_` points at the
  // newest stream of each worker.
  struct Upstream {
    std::string worker;
    grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream = nullptr;
    grpc::ServerContext* context = nullptr;
    int writers = 0;                // Send()s writing to it
    bool ended_on_purpose = false;  // replaced, deactivated or shut down
    absl::Mutex write_mu;           // serialises writes to `stream`
  };

  absl::Status ServeAccepted(Upstream* upstream, const LinkValidator& validator, Inbox* inbox,
                             int64_t* delivered);
  void EndAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads the HELLO under the pending-stream limits and the HELLO timeout.
  grpc::Status ReadHello(grpc::ServerContext* context,
                         grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream,
                         const std::string& pending_key, v1::LinkFrame* hello);

  const LinkSecurityOptions security_;

  // mu_ guards the stream table; each stream's write_mu serialises its
  // writes, so a write blocked by a stalled peer never holds mu_ (Shutdown()
  // and a reconnecting peer can still cancel it). Order: mu_ is never taken
  // while holding a write_mu.
  mutable absl::Mutex mu_;
  std::shared_ptr<const LinkValidator> validator_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Inbox> inbox_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Upstream>> upstreams_ ABSL_GUARDED_BY(mu_);
  // Training microbatch -> the upstream worker its activation came from,
  // until its gradient is sent back.
  std::map<uint64_t, std::string> origin_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::string failed_peer_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> pending_hellos_ ABSL_GUARDED_BY(mu_);
  int pending_total_ ABSL_GUARDED_BY(mu_) = 0;
  // A reply goes back on the stream its request came on; if that stream is
  // gone, wait only briefly for the upstream worker to reconnect.
  absl::Duration connect_wait_ = absl::Seconds(2);
};

// Dials the downstream neighbour and keeps one Link stream to it.
class DownstreamLinkClient final : public MessageSink {
 public:
  // Connects and exchanges HELLOs, retrying with backoff while the peer has
  // not yet seen the plan (for up to `timeout`) or is unreachable (for up to
  // keepalive time + timeout, 15 s, as for a link that goes silent), or
  // until `*stop` is set. REQUIRES: `inbox` and `stop` outlive the returned client.
  // `self_id` goes in the HELLO; `peer_id` (the downstream worker) labels
  // what this link delivers to the inbox and, with TLS, is the identity the
  // peer's certificate must have.
  static absl::StatusOr<std::unique_ptr<DownstreamLinkClient>> Connect(
      const std::string& address, std::shared_ptr<const LinkValidator> validator,
      Inbox* inbox, absl::Duration timeout, const std::atomic<bool>* stop,
      const std::string& self_id = "", const std::string& peer_id = "",
      const LinkSecurityOptions& security = LinkSecurityOptions());

  // Cancels the stream: a blocked Send() fails. Thread-safe.
  void Cancel();
  ~DownstreamLinkClient() override;

  absl::Status Send(const LinkMessage& message) override;
  std::string failed_peer() const override { return peer_id_; }
  // Half-closes, waits for the peer to end the stream, and returns its status.
  absl::Status Close();

 private:
  DownstreamLinkClient() = default;
  void ReadLoop();

  std::string address_;
  std::string peer_id_;
  absl::Duration write_stall_timeout_;
  std::shared_ptr<const LinkValidator> validator_;
  Inbox* inbox_ = nullptr;
  std::unique_ptr<v1::Stage::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> stream_;
  std::thread reader_;
  absl::Mutex write_mu_;
  bool closed_ ABSL_GUARDED_BY(write_mu_) = false;
};

// HELLO header for worker `from_worker` on `from_stage` opening a link
// downstream (also the server's answer, without a worker).
v1::LinkHeader MakeHello(uint64_t epoch, int from_stage, const std::string& from_worker = "");

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_STREAM_H_
