// The worker daemon's composition root: serves the Stage service, joins the
// coordinator, heartbeats, watches the plan, builds its stage, opens links
// and runs the pipeline driver until the job ends.
//
// Threads: Run()'s caller (plan handling, then the driver), a heartbeat
// thread, a plan-watch thread, gRPC's server threads and one link reader.
#ifndef GEOTRAIN_WORKER_WORKER_H_
#define GEOTRAIN_WORKER_WORKER_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "geotrain/v1/coordinator.pb.h"
#include "worker/coordinator_client.h"
#include "worker/link_stream.h"

namespace geotrain {

struct WorkerOptions {
  std::string coordinator = "127.0.0.1:7070";
  std::string listen = "0.0.0.0:0";
  std::string advertise;  // HOST[:PORT] peers dial; default: from listen
  std::string device = "auto";
  int threads = 0;
  std::string name;
  // Peer address (as the plan names it) -> address to dial instead, e.g. a
  // geotrain-linkem relay in front of that peer.
  std::map<std::string, std::string> routes;
  absl::Duration join_timeout = absl::InfiniteDuration();
};

// Parses "PEER=VIA[,PEER=VIA...]" (each a HOST:PORT) into WorkerOptions::routes.
absl::StatusOr<std::map<std::string, std::string>> ParseLinkRoutes(const std::string& spec);

class Worker {
 public:
  explicit Worker(WorkerOptions options);
  ~Worker();

  // Runs until the job ends (OK), Stop() is called (CANCELLED), or a
  // failure that this worker cannot recover from.
  absl::Status Run();
  // Thread-safe; may be called from a signal-handling thread.
  void Stop();

 private:
  absl::Status StartServer();
  void HeartbeatLoop(int interval_ms);
  void WatchLoop();
  // Waits for a plan that gives this worker a stage; nullopt if the job
  // ended (or Stop()) first.
  std::optional<v1::Plan> WaitForAssignment();
  absl::Status Train(const v1::Plan& plan, const v1::StageAssignment& mine);

  const WorkerOptions options_;
  std::atomic<bool> stop_{false};
  CoordinatorClient coordinator_;
  UpstreamLinkServer link_server_;
  std::unique_ptr<grpc::Server> server_;
  std::string advertise_;
  std::string device_name_;  // resolved, e.g. "cpu" or "cuda:0"
  std::string worker_id_;
  v1::JobSpec job_;
  Inbox inbox_{64};
  StatsBoard stats_;

  std::thread heartbeat_thread_;
  std::thread watch_thread_;
  absl::Mutex mu_;
  std::unique_ptr<grpc::ClientContext> watch_context_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::Plan> latest_plan_ ABSL_GUARDED_BY(mu_);
  DownstreamLinkClient* downstream_ ABSL_GUARDED_BY(mu_) = nullptr;  // while training
  bool watch_ended_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_WORKER_H_
