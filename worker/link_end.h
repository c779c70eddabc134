// One end of an open link between neighbouring stages (after the HELLOs),
// whichever end dialled: it reassembles frames, validates each message
// (LinkValidator) and pushes it to the worker's Inbox, and writes the
// driver's messages as frames.
//
// Its lifecycle is one state under one mutex (tensorpipe's pipe_impl.h is
// the model); writes are serialised by a second mutex that holds no state:
//
//   kAnswered --Serve/StartReader--> kReading --Close--> kClosing
//       |                               |                   |
//   EndOnPurpose                   EndOnPurpose        EndOnPurpose
//       v                               v                   v
//   kEndedUnread --Serve--------->  kEnding  <--------------+
//
//   kReading, kClosing, kEnding --the reader returns--> kRetired
//
// kRetired is final: the transport is never touched again (a borrowed gRPC
// stream is gone with its handler). How the reader found the link when it
// returned decides whether the link broke: ended on purpose (kEnding) never
// did; closed by this end (kClosing) did only if a message was refused.
//
// Threading: one reader (Serve(), in the caller's thread or StartReader's);
// Send() from the pipeline driver, one write at a time; EndOnPurpose and
// Close from anywhere. See docs/threading.md.
#ifndef GEOTRAIN_WORKER_LINK_END_H_
#define GEOTRAIN_WORKER_LINK_END_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/link_message.h"
#include "geotrain/v1/coordinator.pb.h"
#include "worker/link_transport.h"
#include "worker/link_validator.h"
#include "worker/message_sink.h"
#include "worker/send_pacer.h"

namespace geotrain {

// Writes `message` as frames on `transport`, back to back; a message of
// kMinTimedMessageBytes or more in at least kTimedMessageFrames frames, so
// the receiver can time its dispersion. A frame that cannot be written
// within `stall_limit` (the peer stopped reading) cancels the transport.
// With a `pacer`, frames are at most its PartBytes() and each waits for
// its reservation (`stop`, when set, cuts the wait short). False when the
// transport failed.
bool WriteLinkMessage(LinkTransport* transport, std::shared_ptr<const LinkMessage> message,
                      absl::Duration stall_limit, SendPacer* pacer = nullptr,
                      absl::Notification* stop = nullptr);

class LinkEnd final : public PipelineLink, public std::enable_shared_from_this<LinkEnd> {
 public:
  struct Peer {
    std::string id;       // worker id at the far end
    std::string address;  // as the plan names it
    PeerSide side = PeerSide::kDownstream;
  };
  enum class State { kAnswered, kReading, kClosing, kEndedUnread, kEnding, kRetired };
  static const char* StateName(State state);

  LinkEnd(std::unique_ptr<LinkTransport> transport, Peer peer, bool dialled,
          std::shared_ptr<const LinkValidator> validator, std::shared_ptr<Inbox> inbox,
          absl::Duration write_stall_timeout);
  // Ends the link if its reader has not returned. A reader thread
  // (StartReader) holds its own reference, so the end outlives it.
  ~LinkEnd() override;

  absl::Status Send(LinkMessage message) override;
  void PaceSends(std::shared_ptr<SendPacer> pacer) override;
  std::string failed_peer() const override { return peer_.id; }
  std::string oldest_pending_peer() const override { return peer_.id; }
  PeerSide side() const override { return peer_.side; }

  // Before reading: `on_forward` sees the header of each training or
  // evaluation activation before it is delivered; `on_end` runs when the
  // reader returns.
  void SetHooks(std::function<void(const v1::LinkHeader&)> on_forward,
                std::function<void()> on_end);
  // Reads until the link ends, in the calling thread, delivering to the
  // inbox. A link that breaks (not ended by this side or cleanly closed by
  // the peer) pushes an error for the driver. Returns why it ended
  // (INVALID_ARGUMENT: a message was refused). Called at most once.
  absl::Status Serve();
  // Serve() on a thread of its own, which keeps the end alive until it
  // returns. REQUIRES: the end is owned by a shared_ptr.
  void StartReader();
  // Ends the link on purpose (a re-plan, a replacement, shutdown): no error
  // is pushed. Blocked sends fail.
  void EndOnPurpose() override;
  // Half-closes and waits up to `timeout` for the peer to end the link
  // (then ends it on purpose: DEADLINE_EXCEEDED).
  absl::Status Close(absl::Duration timeout) override;
  // Waits up to `timeout` for the reader to return; true at once when no
  // reader ever started.
  bool WaitServed(absl::Duration timeout) const;

  State state() const;
  const Peer& peer() const { return peer_; }
  bool dialled() const { return dialled_; }
  std::string description() const { return description_; }

 private:
  // kAnswered -> kReading, kEndedUnread -> kEnding. REQUIRES: called once.
  void BeginReading();
  absl::Status ReadUntilEnd();
  // Cancels the transport unless it is retired. REQUIRES: mu_ held.
  void CancelLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Describe(absl::string_view what) const;

  std::unique_ptr<LinkTransport> transport_;
  const Peer peer_;
  const bool dialled_;
  const std::string description_;
  const std::shared_ptr<const LinkValidator> validator_;
  const std::shared_ptr<Inbox> inbox_;
  const absl::Duration write_stall_timeout_;
  std::function<void(const v1::LinkHeader&)> on_forward_;  // set before reading
  std::function<void()> on_end_;                           // set before reading
  // Serialises writes: a blocked write holds it (the stall watchdog or
  // EndOnPurpose unblocks it). Order: write_mu_ before mu_.
  absl::Mutex write_mu_;
  std::shared_ptr<SendPacer> pacer_ ABSL_GUARDED_BY(write_mu_);  // null: unpaced
  absl::Notification cancelled_;  // a paced write stops waiting
  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kAnswered;
  absl::Notification served_;  // the reader returned
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_END_H_
