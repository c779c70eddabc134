// The fake workers of the simulated swarm: each speaks the real protocol
// to the coordinator with its own identity, on gRPC's callback API (no
// thread per worker):
//   - Enroll: a token and a CSR for its own certificate (TLS), then a
//     channel of its own that presents it;
//   - Join with a session id (a retried join is the same member), a device
//     and layer timings from its speed class (swarm_model.h);
//   - Heartbeat at the period the coordinator gives, answering the probe
//     and measurement tasks it is handed with its region's link figures;
//   - WatchPlan: one stream, reopened with jittered backoff when it ends;
//   - as the last stage of a pipeline, ReportStep at a configured pace;
//   - as a stage's primary, SaveCheckpoint of its layers (zeros of the
//     model's shapes, a few KiB) at a configured period.
// Thread-safe: callbacks run on gRPC's threads; timers on one Timers
// thread.
#ifndef GEOTRAIN_BENCH_SWARM_FAKE_WORKER_H_
#define GEOTRAIN_BENCH_SWARM_FAKE_WORKER_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/transport_security.h"
#include "geotrain/v1/coordinator.grpc.pb.h"

namespace geotrain::swarm {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t);

// Latencies in ms, thread-safe.
class Latencies {
 public:
  void Add(double ms);
  double Quantile(double q) const;
  size_t size() const;
  void Clear();

 private:
  mutable absl::Mutex mu_;
  std::vector<double> ms_ ABSL_GUARDED_BY(mu_);
};

// Failed calls by kind and status code ("Enroll", RESOURCE_EXHAUSTED),
// thread-safe: what the errors a run counts were.
class ErrorTally {
 public:
  void Add(const std::string& call, grpc::StatusCode code);
  // "RESOURCE_EXHAUSTED 120, DEADLINE_EXCEEDED 3" for `call`; "" for none.
  std::string Summary(const std::string& call) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int>, int> counts_ ABSL_GUARDED_BY(mu_);
};

// Runs functions at their time on one thread (retries, backoff).
class Timers {
 public:
  Timers();
  ~Timers();
  void After(std::chrono::milliseconds delay, std::function<void()> f);

 private:
  struct Entry {
    Clock::time_point due;
    uint64_t order;
    std::function<void()> f;
    bool operator>(const Entry& o) const { return due > o.due || (due == o.due && order > o.order); }
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue_;
  uint64_t next_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// What every fake worker shares: the coordinator's address and trust, the
// token, the figures, the timers.
struct SwarmContext {
  std::string address;
  bool tls = false;
  std::string coordinator_ca_pem;  // TLS: the coordinator's serving CA
  std::string token;               // TLS: a worker token with uses enough
  // Enrollment goes over these (no client certificate yet); insecure
  // workers use them for everything.
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> shared_stubs;
  Timers* timers = nullptr;
  // Steps the last stage of a pipeline reports per second (0: none).
  double steps_per_second = 2;
  // The job (its model's layer shapes for checkpoints), and how often a
  // stage's primary uploads its layers (0: never).
  v1::JobSpec job;
  double checkpoint_period_s = 10;
  // Latencies and counts, over all workers.
  Latencies enroll_ms, join_ms, heartbeat_ms;
  std::atomic<int> enrolled{0}, joined{0}, enroll_errors{0}, join_errors{0};
  std::atomic<int> heartbeat_errors{0}, rejoins{0}, plan_streams_opened{0};
  std::atomic<uint64_t> plans_received{0}, steps_reported{0}, step_errors{0};
  std::atomic<uint64_t> probes_answered{0};
  std::atomic<uint64_t> checkpoints_saved{0}, checkpoint_errors{0}, checkpoint_bytes{0};
  Latencies checkpoint_ms;
  ErrorTally errors;
  // Calls whose callback has not run, and streams whose OnDone has not: the
  // swarm frees its workers only once both are 0.
  std::atomic<int> calls_in_flight{0}, streams_open{0};
  // The newest plan epoch seen by anyone, when each worker first saw each
  // epoch (ms after the first worker did).
  absl::Mutex plans_mu;
  std::map<uint64_t, Clock::time_point> epoch_first_seen ABSL_GUARDED_BY(plans_mu);
  Latencies plan_fanout_ms;
  std::atomic<int> newest_step{0};
};

class FakeWorker {
 public:
  FakeWorker(int index, SwarmContext* swarm);
  ~FakeWorker();

  // Enrolls (TLS) and joins, retrying with jittered backoff; then opens the
  // plan stream. Returns at once.
  void Start();
  // Stops heartbeats and step reports (the process "died"); its stream is
  // cancelled. `Revive` joins again as the same member, or as a new one
  // after its lease expired.
  void Silence();
  void Revive();
  // One heartbeat (the driver calls it at the period).
  void Heartbeat();
  // Cancels the stream and starts nothing more (at the end of a run). The
  // worker may be freed once the context's calls and streams are 0.
  void Stop();

  int index() const { return index_; }
  bool joined() const { return joined_; }
  bool silent() const { return silent_; }
  std::string id() const;
  uint64_t epoch() const { return epoch_; }
  // The workers of the newest plan it has.
  std::set<std::string> plan_members() const;
  // After a coordinator restart: a heartbeat it answered as a known member
  // since `since`, and a plan stream open.
  bool AttachedSince(Clock::time_point since) const;

 private:
  class PlanReader;
  void Enroll();
  void Join();
  void OpenPlanStream();
  void OnPlan(const v1::Plan& plan);
  void OnPlanStreamEnded();
  void ReportSteps();
  // Uploads its stage's layers while it is a primary, then again after the
  // period (on the Timers thread, synchronously: a few KiB).
  void SaveCheckpoints();
  void Retry(std::function<void()> f, std::atomic<int>* attempts);
  // Its own channel's stub once enrolled (TLS), else a shared one.
  v1::Coordinator::Stub* stub() const;
  v1::Coordinator::Stub* StubLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Coordinator::Stub* SharedStub() const;

  const int index_;
  SwarmContext* const swarm_;
  const std::string name_, session_;
  std::atomic<bool> joined_{false}, ever_joined_{false}, silent_{false}, stopped_{false};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> last_known_heartbeat_ns_{0};
  std::atomic<int> enroll_attempts_{0}, join_attempts_{0}, stream_attempts_{0};

  mutable absl::Mutex mu_;
  std::string id_ ABSL_GUARDED_BY(mu_);
  TransportSecurity security_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<v1::Coordinator::Stub> own_stub_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> plan_members_ ABSL_GUARDED_BY(mu_);
  // The last stage of pipeline `last_of_pipeline_` (-1: none) reports steps
  // from `next_step_`.
  int last_of_pipeline_ ABSL_GUARDED_BY(mu_) = -1;
  int next_step_ ABSL_GUARDED_BY(mu_) = 0;
  bool reporting_ ABSL_GUARDED_BY(mu_) = false;
  // The layers of the stage it is the primary of ([begin, end); empty:
  // none), and whether its uploads are scheduled.
  int primary_begin_ ABSL_GUARDED_BY(mu_) = 0, primary_end_ ABSL_GUARDED_BY(mu_) = 0;
  bool checkpointing_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<PlanReader> reader_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<PlanReader>> ended_readers_ ABSL_GUARDED_BY(mu_);
  // Results of the probe tasks the last heartbeat handed out.
  std::vector<v1::ProbeResult> probe_results_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::AccessProbeResult> access_results_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain::swarm

#endif  // GEOTRAIN_BENCH_SWARM_FAKE_WORKER_H_
