// The links from the stage upstream, by worker: the MessageSink for
// gradients. Each gradient goes back on the link its activation came on
// (the worker that ran the forward holds its stashed weights).
#ifndef GEOTRAIN_WORKER_UPSTREAM_LINKS_H_
#define GEOTRAIN_WORKER_UPSTREAM_LINKS_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "geotrain/v1/coordinator.pb.h"
#include "worker/link_end.h"
#include "worker/message_sink.h"

namespace geotrain {

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

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_UPSTREAM_LINKS_H_
