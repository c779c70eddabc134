// WatchPlan streams, pushed: each call gets a gRPC callback reactor (no
// thread per stream; 1,000 streams hold no thread between writes), and
// every plan the PlanPublisher makes visible is offered to every open
// stream from the publisher's own notification. A stream sends the plan
// visible when it opened, then each newer one; while a write is in flight
// only the newest waits (latest wins). It ends with the job_done plan
// (OK), when its caller goes (CANCELLED), or at Shutdown (UNAVAILABLE).
// Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_PLAN_STREAMS_H_
#define GEOTRAIN_COORDINATOR_PLAN_STREAMS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "coordinator/plan_publisher.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class PlanStreams {
 public:
  // What `worker` is sent of `plan` (PlanViewFor, revocations).
  using ViewFn = std::function<v1::Plan(const v1::Plan& plan, const std::string& worker)>;

  explicit PlanStreams(ViewFn view) : view_(std::move(view)) {}
  ~PlanStreams();

  // The reactor of one WatchPlan call by `worker`; `current`: the plan
  // visible now (null: none yet). `release` runs once the call is done
  // (its place in a limit of streams).
  grpc::ServerWriteReactor<v1::Plan>* Open(const std::string& worker,
                                           PlanPublisher::PlanPtr current,
                                           std::function<void()> release);
  // A plan made visible (PlanPublisher's listener).
  void Publish(const PlanPublisher::PlanPtr& plan);
  // Ends every stream with UNAVAILABLE; later ones end at once.
  void Shutdown();
  // Streams open now.
  int open() const;

 private:
  class Stream;
  void Remove(Stream* stream);

  const ViewFn view_;
  mutable absl::Mutex mu_;
  std::map<Stream*, std::weak_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
  PlanPublisher::PlanPtr newest_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PLAN_STREAMS_H_
