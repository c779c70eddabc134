#include "worker/link_end.h"

#include <algorithm>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/link_rate_meter.h"
#include "common/logging.h"
#include "worker/stall_watchdog.h"

namespace geotrain {
namespace {

// A reader that spent this long handing a message to the inbox was held up
// by it; what it reads next arrived meanwhile (see LinkRateMeter).
constexpr absl::Duration kStall = absl::Milliseconds(1);

}  // namespace

bool WriteLinkMessage(LinkTransport* transport, std::shared_ptr<const LinkMessage> message,
                      absl::Duration stall_limit, SendPacer* pacer, absl::Notification* stop) {
  const size_t size = message->payload.size();
  size_t frame_bytes =
      size >= kMinTimedMessageBytes
          ? std::min(kFrameBytes, (size + kTimedMessageFrames - 1) / kTimedMessageFrames)
          : kFrameBytes;
  if (pacer != nullptr) {
    frame_bytes = std::max<size_t>(1, std::min(frame_bytes, pacer->PartBytes()));
  }
  for (const FrameRange& range : FrameRanges(size, frame_bytes)) {
    if (pacer != nullptr) {
      const absl::Duration wait = pacer->Reserve(range.size);
      if (wait > absl::ZeroDuration()) {
        if (stop != nullptr ? stop->WaitForNotificationWithTimeout(wait)
                            : (absl::SleepFor(wait), false)) {
          return false;
        }
      }
    }
    StallWatchdog::Guard guard =
        StallWatchdog::Shared().Watch(stall_limit, [transport] { transport->Cancel(); });
    if (!transport->Write(OutgoingFrame{message, range})) {
      if (guard.stalled()) {
        GT_LOG(Warning) << "cut a link whose peer read nothing for "
                        << absl::FormatDuration(stall_limit);
      }
      return false;
    }
  }
  return true;
}


const char* LinkEnd::StateName(State state) {
  switch (state) {
    case State::kAnswered: return "answered";
    case State::kReading: return "reading";
    case State::kClosing: return "closing";
    case State::kEndedUnread: return "ended before reading";
    case State::kEnding: return "ending";
    case State::kRetired: return "retired";
  }
  return "?";
}

LinkEnd::LinkEnd(std::unique_ptr<LinkTransport> transport, Peer peer, bool dialled,
                 std::shared_ptr<const LinkValidator> validator, std::shared_ptr<Inbox> inbox,
                 absl::Duration write_stall_timeout)
    : transport_(std::move(transport)),
      peer_(std::move(peer)),
      dialled_(dialled),
      description_(transport_->description()),
      validator_(std::move(validator)),
      inbox_(std::move(inbox)),
      write_stall_timeout_(write_stall_timeout) {}

LinkEnd::~LinkEnd() {
  if (!served_.HasBeenNotified()) EndOnPurpose();
}

void LinkEnd::SetHooks(std::function<void(const v1::LinkHeader&)> on_forward,
                       std::function<void()> on_end) {
  on_forward_ = std::move(on_forward);
  on_end_ = std::move(on_end);
}

LinkEnd::State LinkEnd::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

std::string LinkEnd::Describe(absl::string_view what) const {
  return absl::StrCat(PeerSideName(peer_.side), " link to '", peer_.id, "' (", description_,
                      ") ", what);
}

void LinkEnd::CancelLocked() {
  if (state_ != State::kRetired) transport_->Cancel();
}

void LinkEnd::EndOnPurpose() {
  absl::MutexLock lock(&mu_);
  switch (state_) {
    case State::kAnswered:
      state_ = State::kEndedUnread;
      break;
    case State::kReading:
    case State::kClosing:
      state_ = State::kEnding;
      break;
    case State::kEndedUnread:
    case State::kEnding:
    case State::kRetired:
      return;
  }
  if (!cancelled_.HasBeenNotified()) cancelled_.Notify();
  CancelLocked();
}

void LinkEnd::PaceSends(std::shared_ptr<SendPacer> pacer) {
  absl::MutexLock lock(&write_mu_);
  pacer_ = std::move(pacer);
}

absl::Status LinkEnd::Send(LinkMessage message) {
  auto shared = std::make_shared<const LinkMessage>(std::move(message));
  absl::MutexLock lock(&write_mu_);
  if (state() == State::kRetired) return absl::UnavailableError(Describe("is closed"));
  // The reader cannot retire the transport while write_mu_ is held.
  if (!WriteLinkMessage(transport_.get(), std::move(shared), write_stall_timeout_, pacer_.get(),
                        &cancelled_)) {
    return absl::UnavailableError(Describe("broke while sending"));
  }
  return absl::OkStatus();
}

void LinkEnd::BeginReading() {
  absl::MutexLock lock(&mu_);
  if (state_ == State::kAnswered) state_ = State::kReading;
  if (state_ == State::kEndedUnread) state_ = State::kEnding;
}

absl::Status LinkEnd::Serve() {
  BeginReading();
  return ReadUntilEnd();
}

void LinkEnd::StartReader() {
  BeginReading();
  std::thread([self = shared_from_this()] { (void)self->ReadUntilEnd(); }).detach();
}

absl::Status LinkEnd::ReadUntilEnd() {
  const PeerSide side = peer_.side;
  const bool from_upstream = side == PeerSide::kUpstream;
  const LinkValidator* validator = validator_.get();
  FrameAssembler assembler(kMaxMessageBytes, [validator, side](const v1::LinkHeader& h) {
    switch (side) {
      case PeerSide::kUpstream: return validator->CheckHeaderFromUpstream(h);
      case PeerSide::kDownstream: return validator->CheckHeaderFromDownstream(h);
      case PeerSide::kReplica: return validator->CheckHeaderFromReplica(h);
    }
    return absl::InternalError("no such side");
  });
  IncomingFrame frame;
  absl::Status failure;
  bool after_stall = false, stopping = false;
  std::vector<FrameArrival> arrivals;  // of the message being assembled
  int64_t delivered = 0;
  while (transport_->Read(&frame)) {
    absl::StatusOr<FrameParts> parts = ParseFrame(frame.pieces);
    if (!parts.ok()) {
      failure = parts.status();
      break;
    }
    if (parts->header.has_value()) arrivals.clear();
    // Bounded whatever a peer sends (empty frames, say): past the limit the
    // last entry stands for every later frame, so the last arrival and the
    // bytes after each earlier one stay exact.
    if (arrivals.size() < kMaxTimedFrameArrivals) {
      arrivals.push_back({absl::Now(), parts->data_bytes});
    } else {
      arrivals.back().at = absl::Now();
      arrivals.back().bytes += parts->data_bytes;
    }
    absl::StatusOr<std::optional<LinkMessage>> added = assembler.Add(*std::move(parts));
    if (!added.ok()) {
      failure = added.status();
      break;
    }
    if (!added->has_value()) continue;
    LinkMessage& message = **added;
    const TrainTiming train = TimeTrain(arrivals);
    failure = side == PeerSide::kUpstream     ? validator->CheckFromUpstream(message)
              : side == PeerSide::kDownstream ? validator->CheckFromDownstream(message)
                                              : validator->CheckFromReplica(message);
    if (!failure.ok()) break;
    if (from_upstream && on_forward_ &&
        (message.header.kind() == v1::MESSAGE_KIND_ACTIVATION ||
         message.header.kind() == v1::MESSAGE_KIND_EVAL)) {
      on_forward_(message.header);
    }
    const absl::Time pushing = absl::Now();
    InboundMessage in{from_upstream, std::move(message), absl::OkStatus(),
                      train.trailing_bytes, train.dispersion, after_stall};
    in.peer = peer_.id;
    in.from_replica = side == PeerSide::kReplica;
    in.link_epoch = validator_->epoch();
    if (!inbox_->Push(std::move(in))) {
      stopping = true;  // the worker is ending this attempt
      break;
    }
    after_stall = absl::Now() - pushing > kStall;
    ++delivered;
  }
  if ((!failure.ok() || stopping) && !transport_->ends_when_served()) {
    absl::MutexLock lock(&mu_);
    CancelLocked();
  }
  absl::Status ended;
  State last;
  {
    // No write is in flight once write_mu_ is held (one blocked on a peer
    // that stopped reading fails within the stall limit); none starts
    // afterwards. How the peer ended the link is read before anything here
    // cancels it.
    absl::MutexLock write_lock(&write_mu_);
    ended = failure.ok() ? transport_->Finish() : failure;
    absl::MutexLock lock(&mu_);
    last = state_;
    state_ = State::kRetired;
  }
  // A link this worker opened is broken unless it closed it. One a peer
  // opened is broken when it was cut (not cleanly closed) after carrying
  // traffic, or at once for a downstream peer (this worker sends to it); a
  // refused message only ends that stream (the peer may open another), so
  // a hostile stream cannot stop the pipeline.
  const bool broken =
      last != State::kEnding && !stopping &&
      (dialled_ ? !failure.ok() || last != State::kClosing
                : failure.ok() && !ended.ok() && (delivered > 0 || !from_upstream));
  if (!failure.ok()) {
    GT_LOG(Error) << "refused a message on the " << PeerSideName(peer_.side) << " link to '"
                  << peer_.id << "' (" << description_ << "): " << failure.message();
  }
  if (broken) {
    const std::string why = Describe(
        failure.ok() ? (ended.ok() ? "ended unexpectedly" : "broke: " + std::string(ended.message()))
                     : "refused a message: " + std::string(failure.message()));
    GT_LOG(Error) << why;
    InboundMessage message{from_upstream, LinkMessage(), absl::UnavailableError(why)};
    message.peer = peer_.id;
    message.from_replica = side == PeerSide::kReplica;
    message.link_epoch = validator_->epoch();
    inbox_->TryPush(std::move(message));
  }
  const std::function<void()> on_end = on_end_;
  if (on_end) on_end();
  served_.Notify();
  return ended;
}

absl::Status LinkEnd::Close(absl::Duration timeout) {
  {
    absl::MutexLock lock(&mu_);
    if (state_ == State::kAnswered || state_ == State::kReading) state_ = State::kClosing;
  }
  {
    absl::MutexLock lock(&write_mu_);
    LinkTransport* transport = transport_.get();
    StallWatchdog::Guard guard = StallWatchdog::Shared().Watch(
        write_stall_timeout_, [transport] { transport->Cancel(); });
    if (state() != State::kRetired) transport_->CloseWrites();
  }
  if (!served_.WaitForNotificationWithTimeout(timeout)) {
    EndOnPurpose();
    if (state() != State::kEndedUnread) served_.WaitForNotification();
    return absl::DeadlineExceededError(absl::StrCat(
        "the peer of the ", PeerSideName(peer_.side), " link to '", peer_.id,
        "' did not close it within ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

bool LinkEnd::WaitServed(absl::Duration timeout) const {
  {
    absl::MutexLock lock(&mu_);
    if (state_ == State::kAnswered || state_ == State::kEndedUnread) return true;
  }
  return served_.WaitForNotificationWithTimeout(timeout);
}

}  // namespace geotrain
