// Sends a stage's downstream messages to the workers of the next stage: one,
// or several when that stage has replicas.
//
// Each training microbatch goes to the worker expected to finish it first:
// the lowest (outstanding + 1) x latency, where `outstanding` counts the
// microbatches sent to it whose gradient has not returned and `latency` is
// a moving average of the time from sending a microbatch to its gradient's
// return that jumps up at once on a slow sample and decays slowly (the
// "peak EWMA" least-loaded rule of Finagle's balancers). A worker holding a
// microbatch for longer than its average counts at least that age, so a
// paused worker looks slower every moment and stops receiving new work at
// once, without a timeout to tune. Without new samples the average fades
// (time constant 2 s), so a worker once slow is tried again. A worker with
// nothing measured yet counts zero latency and so is tried first.
//
// An evaluation pass goes whole to one worker (its EVAL_END must follow its
// microbatches down the same path); DONE goes to every worker.
//
// Thread-safe. Send() may block in the chosen sink; the routing state is
// not locked meanwhile.
#ifndef GEOTRAIN_WORKER_REPLICA_ROUTER_H_
#define GEOTRAIN_WORKER_REPLICA_ROUTER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "geotrain/v1/status.pb.h"
#include "worker/message_sink.h"

namespace geotrain {

class ReplicaRouter final : public MessageSink {
 public:
  struct Route {
    std::string peer_id;  // the worker's id
    std::string address;  // for statistics
    MessageSink* sink;    // not owned; outlives the router
  };
  // REQUIRES: `routes` is not empty.
  explicit ReplicaRouter(std::vector<Route> routes,
                         std::function<absl::Time()> now = [] { return absl::Now(); });

  absl::Status Send(LinkMessage message) override;
  // The gradient of `microbatch` came back: updates its route's latency.
  // Unknown ids (dropped, or sent before a re-plan) are ignored.
  void OnReply(uint64_t microbatch) override;
  std::string failed_peer() const override;
  std::string oldest_pending_peer() const override;

  std::vector<v1::RouteStats> Stats() const;

 private:
  struct RouteState {
    Route route;
    uint64_t sent = 0;
    double latency_s = 0;  // 0: nothing measured yet
    absl::Time last_reply_at = absl::InfinitePast();
    std::map<uint64_t, absl::Time> outstanding;  // microbatch -> sent at
    uint64_t sent_end = 0;  // the highest microbatch id sent on it, plus one
  };
  // The route expected to finish one more microbatch first.
  int ChooseLocked(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SendTo(int route, LinkMessage message);

  const std::function<absl::Time()> now_;
  mutable absl::Mutex mu_;
  std::vector<RouteState> routes_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, int> route_of_ ABSL_GUARDED_BY(mu_);  // outstanding microbatch -> route
  int eval_route_ ABSL_GUARDED_BY(mu_) = -1;  // the route of the evaluation pass under way
  std::string failed_peer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_REPLICA_ROUTER_H_
