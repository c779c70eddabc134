// WatchPlan streams, pushed, on gRPC's asynchronous API: every stream is
// driven from one completion queue by one thread (no thread per stream),
// and every plan the PlanPublisher makes visible is offered to every open
// stream from the publisher's own notification. A stream sends the plan
// visible when it opened, then each newer one; while a write is in flight
// only the newest waits (latest wins). It ends with the job_done plan
// (OK), when its caller goes (CANCELLED), or at Shutdown (UNAVAILABLE).
//
// Not the callback API: in this gRPC (1.51) a server with callback methods
// polls them from "nexting" threads that sleep 100 ms whenever a second
// passes without an event, and every other call of the server waited out
// those sleeps (heartbeat p99 ~90 ms in bench/swarm, p50 0.4 ms).
//
// Use: Attach before the server is built, Start after, Shutdown before the
// server's Shutdown, Stop after it. Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_PLAN_STREAMS_H_
#define GEOTRAIN_COORDINATOR_PLAN_STREAMS_H_

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/async_stream.h>

#include "absl/synchronization/mutex.h"
#include "coordinator/plan_publisher.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class PlanStreams {
 public:
  // What `worker` is sent of `plan` (PlanViewFor, revocations).
  using ViewFn = std::function<v1::Plan(const v1::Plan& plan, const std::string& worker)>;
  // Admits a call: the worker it is (and its place in a limit of streams)
  // or the status that refuses it.
  using AdmitFn = std::function<grpc::Status(const grpc::ServerContext& context,
                                             const v1::WatchPlanRequest& request,
                                             std::string* worker)>;
  // Gives back the place an admitted stream held.
  using ReleaseFn = std::function<void(const std::string& worker)>;
  // The service's RequestWatchPlan (WithAsyncMethod_WatchPlan).
  using RequestFn =
      std::function<void(grpc::ServerContext* context, v1::WatchPlanRequest* request,
                         grpc::ServerAsyncWriter<v1::Plan>* writer,
                         grpc::ServerCompletionQueue* queue, void* tag)>;

  PlanStreams(ViewFn view, AdmitFn admit, ReleaseFn release,
              std::function<PlanPublisher::PlanPtr()> visible);
  ~PlanStreams();

  void Attach(grpc::ServerBuilder* builder);
  void Start(RequestFn request);
  // A plan made visible (PlanPublisher's listener).
  void Publish(const PlanPublisher::PlanPtr& plan);
  // Ends every stream with UNAVAILABLE and refuses new ones.
  void Shutdown();
  // Drains the queue and joins its thread. REQUIRES: the server is shut
  // down.
  void Stop();
  // Streams open now.
  int open() const;

 private:
  class Stream;
  struct Tag;
  void Accept();  // a new stream waits for the next call
  void Handle(Tag* tag, bool ok);
  void Forget(Stream* stream);

  const ViewFn view_;
  const AdmitFn admit_;
  const ReleaseFn release_;
  const std::function<PlanPublisher::PlanPtr()> visible_;
  RequestFn request_;
  std::unique_ptr<grpc::ServerCompletionQueue> queue_;
  std::thread thread_;
  mutable absl::Mutex mu_;
  std::set<Stream*> open_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // Streams whose call never started (the server shut down first): freed
  // once the queue is drained.
  std::vector<Stream*> unstarted_;  // the queue's thread only
  bool stopped_ = false;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PLAN_STREAMS_H_
