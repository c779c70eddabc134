// The Stage service: accepts Link streams from either neighbouring stage
// or from a replica of this stage in another pipeline (the HELLO's stage
// says which), bounded in number and time before their
// HELLO, and answers reachability probes and measurements.
//
// Threading: gRPC's sync API; the handler thread of a stream is its link's
// reader. See docs/threading.md.
#ifndef GEOTRAIN_WORKER_LINK_SERVICE_H_
#define GEOTRAIN_WORKER_LINK_SERVICE_H_

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "geotrain/v1/stage.grpc.pb.h"
#include "worker/link_end.h"
#include "worker/link_options.h"
#include "worker/link_transport.h"
#include "worker/link_validator.h"
#include "worker/message_sink.h"
#include "worker/upstream_links.h"

namespace geotrain {

// The Stage service: accepts Link streams for the active plan and answers
// probes. Until Activate() every stream is refused with FAILED_PRECONDITION.
// A stream from upstream (HELLO from stage - 1, a worker the plan puts
// there) joins UpstreamLinks; one from downstream (stage + 1, a worker the
// plan says dials this one) waits for AwaitDialIn(kDownstream); one from
// a replica of this stage (the same stage, a worker the plan links with
// this one for the outer sync) waits for AwaitDialIn(kReplica). Malformed or
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
  // The link the downstream worker (or replica) `id` dialled for the active
  // plan, waiting up to `timeout` (UNAVAILABLE then) or until `*stop`.
  // REQUIRES: `side` is kDownstream or kReplica.
  absl::StatusOr<std::shared_ptr<LinkEnd>> AwaitDialIn(PeerSide side, const std::string& id,
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
  // The links downstream workers and replicas dialled in, by side and id.
  using DialledIn = std::pair<PeerSide, std::string>;
  std::map<DialledIn, std::shared_ptr<LinkEnd>> dialled_in_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, int> pending_hellos_ ABSL_GUARDED_BY(mu_);
  int pending_total_ ABSL_GUARDED_BY(mu_) = 0;
  // Measure replies (MeasureRequest.reply_bytes) sent in the current
  // window: a few bytes ask for up to 1 MiB, so what any callers may draw
  // is bounded (kMeasureReplyBudgetBytes per kMeasureReplyWindow).
  absl::Time reply_window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t reply_bytes_in_window_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_LINK_SERVICE_H_
