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
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/bounded_queue.h"
#include "common/link_message.h"
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
};
using Inbox = BoundedQueue<InboundMessage>;

// Where the pipeline driver sends a message. Thread-safe.
class MessageSink {
 public:
  virtual ~MessageSink() = default;
  virtual absl::Status Send(const LinkMessage& message) = 0;
};

// Serves Link streams from the upstream neighbour. Until Activate() every
// stream is refused with FAILED_PRECONDITION; afterwards one stream at a time
// is accepted if its HELLO matches the plan. Malformed or inconsistent
// messages end that stream with INVALID_ARGUMENT; the worker keeps running.
class UpstreamLinkServer final : public v1::Stage::Service, public MessageSink {
 public:
  UpstreamLinkServer() = default;

  // Accepts streams for `validator`'s plan epoch, delivering to `inbox`
  // (shared: a stream of an older epoch may still be finishing).
  void Activate(std::shared_ptr<const LinkValidator> validator, std::shared_ptr<Inbox> inbox);
  // Ends the active stream, if any, and refuses new ones (as before the
  // first Activate) until the next Activate: the plan changed.
  void Deactivate();

  grpc::Status Link(grpc::ServerContext* context,
                    grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream)
      override;

  // Sends to the current upstream stream, waiting up to `connect_wait` for
  // one to be accepted. UNAVAILABLE when there is none or it broke.
  absl::Status Send(const LinkMessage& message) override;

  // Cancels the active stream, if any.
  void Shutdown();

 private:
  absl::Status ServeAccepted(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream,
      const LinkValidator& validator, Inbox* inbox, int64_t* delivered);

  // mu_ guards which stream is current; write_mu_ serialises writes, so a
  // write blocked by a stalled peer never holds mu_ (Shutdown() and a
  // reconnecting peer can still cancel it). Order: mu_ is never taken while
  // holding write_mu_.
  absl::Mutex mu_;
  absl::Mutex write_mu_;
  std::shared_ptr<const LinkValidator> validator_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Inbox> inbox_ ABSL_GUARDED_BY(mu_);
  grpc::ServerReaderWriter<v1::LinkFrame, v1::LinkFrame>* stream_
      ABSL_GUARDED_BY(mu_) = nullptr;
  grpc::ServerContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  int writers_ ABSL_GUARDED_BY(mu_) = 0;  // Send()s using stream_
  bool replacing_ ABSL_GUARDED_BY(mu_) = false;    // a newer stream wins
  bool deactivated_ ABSL_GUARDED_BY(mu_) = false;  // the plan changed
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // A reply goes back on the stream its request came on; if that stream is
  // gone, wait only briefly for the upstream worker to reconnect.
  absl::Duration connect_wait_ = absl::Seconds(2);
};

// Dials the downstream neighbour and keeps one Link stream to it.
class DownstreamLinkClient final : public MessageSink {
 public:
  // Connects and exchanges HELLOs, retrying with backoff while the peer is
  // unreachable or has not yet seen the plan, for up to `timeout` or until
  // `*stop` is set. REQUIRES: `inbox` and `stop` outlive the returned client.
  static absl::StatusOr<std::unique_ptr<DownstreamLinkClient>> Connect(
      const std::string& address, std::shared_ptr<const LinkValidator> validator,
      Inbox* inbox, absl::Duration timeout, const std::atomic<bool>* stop);

  // Cancels the stream: a blocked Send() fails. Thread-safe.
  void Cancel();
  ~DownstreamLinkClient() override;

  absl::Status Send(const LinkMessage& message) override;
  // Half-closes, waits for the peer to end the stream, and returns its status.
  absl::Status Close();

 private:
  DownstreamLinkClient() = default;
  void ReadLoop();

  std::string address_;
  std::shared_ptr<const LinkValidator> validator_;
  Inbox* inbox_ = nullptr;
  std::unique_ptr<v1::Stage::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::LinkFrame, v1::LinkFrame>> stream_;
  std::thread reader_;
  absl::Mutex write_mu_;
  bool closed_ ABSL_GUARDED_BY(write_mu_) = false;
};

// HELLO header for `validator`'s stage opening a link downstream.
v1::LinkHeader MakeHello(uint64_t epoch, int from_stage);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_STREAM_H_
