// A simulated swarm over the real protocol: N fake workers in this one
// process (fake_worker.h) against a real geotrain-coordinator in its own
// process on loopback. With TLS (the default) each worker enrolls with a
// token and its own CSR and talks over a channel of its own that presents
// its certificate. Workers join with a speed class and report their
// region's links when the coordinator asks (swarm_model.h), so the
// network planner (the default) plans them; the last stage of each
// pipeline reports steps.
//
// Each stage's primary uploads its layers (the model's shapes, zeros) every
// --checkpoint_s, as a real stage does every checkpoint_every steps.
//
// For each N it prints:
//   - enrollment and join: p50/p99, errors, the time until all joined, and
//     the members the coordinator counts (a retried join must not add one);
//   - the time to the first plan;
//   - steady state (every worker heartbeating every lease/5, 1 s by
//     default; status polled five times a second):
//     Heartbeat and first-page Status p50/p99, the first page's size, the
//     coordinator's CPU, RSS per member and threads from /proc, plan
//     messages per worker per minute, and the events log's bytes per minute;
//   - a mass failure: 10% of the members (the plan's among them) go silent
//     at once; the time until a published plan excludes them, and plan
//     fan-out (from the first worker that has an epoch to each other);
//   - with --restart: a kill -9 of the coordinator and a restart on the
//     same state: the time until every live member heartbeats as known and
//     holds a plan stream again, members lost, and whether the step count
//     went back;
//   - with --churn_s: a seeded script of deaths, pauses and returns.
//
// Run: build/bench/swarm [--workers=100,1000,10000] [--steady_s=15]
//      [--restart] [--churn_s=30] [--insecure] [--planner=join-order]
//      [--lease_ms=5000] (workers heartbeat every fifth of the lease)
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "bench/swarm/coordinator_process.h"
#include "bench/swarm/fake_worker.h"
#include "common/job_spec.h"
#include "common/transport_security.h"
#include "geotrain/v1/status.grpc.pb.h"

ABSL_FLAG(std::string, workers, "100,1000", "swarm sizes, comma-separated (5 to 10000)");
ABSL_FLAG(std::string, coordinator_bin, "", "geotrain-coordinator (default: next to this bench)");
ABSL_FLAG(int, steady_s, 15, "seconds of heartbeats measured once all have joined");
ABSL_FLAG(int, arrivals_per_s, 500, "workers that start per second (they arrive, not all at once)");
ABSL_FLAG(bool, insecure, false, "run the coordinator --insecure (no enrollment, no TLS)");
ABSL_FLAG(std::string, planner, "network", "the coordinator's --planner");
ABSL_FLAG(bool, restart, false, "kill -9 the coordinator and restart it on the same state");
ABSL_FLAG(int, churn_s, 0, "seconds of seeded churn (deaths, pauses, returns); 0: none");
ABSL_FLAG(int, seed, 1, "the churn script's seed");
ABSL_FLAG(double, steps_per_second, 2, "steps each pipeline's last stage reports per second");
ABSL_FLAG(double, checkpoint_s, 10,
          "seconds between the checkpoint uploads of each stage's primary (0: none)");
ABSL_FLAG(int, lease_ms, 5000,
          "the job's lease; workers heartbeat every fifth of it (at 10,000 workers 50000 keeps "
          "the 1,000 heartbeats a second of 1,000 workers at 5000)");

namespace geotrain::swarm {
namespace {

struct Row {
  int n = 0, enrolled = 0, joined = 0, members = 0, enroll_errors = 0, join_errors = 0;
  double enroll_p50 = 0, enroll_p99 = 0, join_p50 = 0, join_p99 = 0, all_joined_s = -1;
  double first_plan_s = -1, hb_p50 = 0, hb_p99 = 0, status_p50 = 0, status_p99 = 0;
  size_t status_bytes = 0;
  std::string status_fields;
  double cpu_cores = 0, rss_mib = 0, rss_kib_per_member = 0;
  int threads = 0;
  int heartbeat_errors = 0, bench_fds = 0, bench_fd_limit = 0, plan_streams_opened = 0;
  std::string enroll_codes, join_codes, heartbeat_codes, checkpoint_codes;
  double plans_per_worker_minute = 0, events_bytes_per_minute = 0, metrics_bytes_per_minute = 0;
  uint64_t checkpoints_saved = 0, checkpoint_errors = 0, checkpoint_bytes = 0;
  double checkpoint_p50 = 0, checkpoint_p99 = 0;
  double replan_s = -1, fanout_p50 = 0, fanout_p99 = 0;
  int pipelines = 0;
  double planning_s = -1;  // the slowest full plan the status showed
  int planning_candidates = 0;
  // --restart
  double reattach_s = -1, reattach_99_s = -1;
  int reattached = 0, reattach_live = 0;  // when the wait ended
  int members_after_restart = -1, step_before = 0, step_after = 0;
  // --churn_s
  int churn_deaths = 0, churn_pauses = 0, churn_plans = 0, churn_members = 0;
};

// Descriptors this process has open, and its limit (counted without
// opening one: at the limit /proc/self/fd could not be listed).
std::pair<int, int> OpenDescriptors() {
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  const int limit = static_cast<int>(std::min<rlim_t>(files.rlim_cur, 1 << 20));
  int open = 0;
  for (int fd = 0; fd < limit; ++fd) open += fcntl(fd, F_GETFD) != -1;
  return {open, limit};
}

uint64_t FileSize(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

std::string JobText() {
  return absl::StrCat("name: \"swarm\"\n"
                      "gpt { context: 8 d_model: 16 heads: 2 blocks: 6 }\n"
                      "text {}\nsteps: 100000000\nmin_workers: 4\nlease_ms: ",
                      absl::GetFlag(FLAGS_lease_ms),
                      "\nouter { inner_steps: 50 lr: 0.7 momentum: 0.9 codec: CODEC_INT8 "
                      "max_pipelines: 8 }\n");
}

std::string WriteJob(const std::string& dir) {
  const std::string path = dir + "/swarm.textproto";
  std::ofstream(path) << JobText();
  return path;
}

// The status's three largest fields and their bytes, e.g. "workers 120 KB".
std::string LargestFields(const v1::ClusterStatus& status) {
  const google::protobuf::Reflection* reflection = status.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(status, &fields);
  std::vector<std::pair<size_t, std::string>> sizes;
  for (const google::protobuf::FieldDescriptor* field : fields) {
    v1::ClusterStatus only;
    only.CopyFrom(status);
    std::vector<const google::protobuf::FieldDescriptor*> others;
    only.GetReflection()->ListFields(only, &others);
    for (const google::protobuf::FieldDescriptor* other : others) {
      if (other != field) only.GetReflection()->ClearField(&only, other);
    }
    sizes.push_back({only.ByteSizeLong(), field->name()});
  }
  std::sort(sizes.rbegin(), sizes.rend());
  std::string out;
  for (size_t i = 0; i < sizes.size() && i < 3; ++i) {
    absl::StrAppend(&out, i > 0 ? ", " : "", sizes[i].second, " ", sizes[i].first / 1024, " KiB");
  }
  return out;
}

// The admin's channel, a worker token, and the coordinator's CA.
struct Admin {
  std::unique_ptr<v1::Admin::Stub> admin;
  std::unique_ptr<v1::Status::Stub> status;
  std::string token, ca_pem;
};

absl::StatusOr<Admin> Administer(const CoordinatorProcess& coordinator, bool tls) {
  Admin admin;
  TransportSecurity security;
  if (tls) {
    absl::StatusOr<TransportSecurity> loaded =
        LoadCredentialFile(coordinator.state_dir() + "/tls/admin.credential");
    if (!loaded.ok()) return loaded.status();
    security = *loaded;
    admin.ca_pem = security.trusted_ca_pem;
  }
  auto channel = MakeSecureChannel(coordinator.address(), security, kCoordinatorServerName,
                                   Connection::kOwn);
  admin.admin = v1::Admin::NewStub(channel);
  admin.status = v1::Status::NewStub(channel);
  if (!tls) return admin;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::CreateTokenRequest request;
  request.set_label("swarm");
  request.set_ttl_s(3600);
  v1::CreateTokenResponse response;
  const grpc::Status status = admin.admin->CreateToken(&context, request, &response);
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat("token create: ", status.error_message()));
  }
  admin.token = response.token();
  return admin;
}

// The swarm of one run: its context, workers and the drivers that beat
// their hearts and poll the status.
class Swarm {
 public:
  Swarm(int n, const CoordinatorProcess& coordinator, const Admin& admin, bool tls,
        const v1::JobSpec& job) {
    context_.job = job;
    context_.checkpoint_period_s = absl::GetFlag(FLAGS_checkpoint_s);
    context_.address = coordinator.address();
    context_.tls = tls;
    context_.coordinator_ca_pem = admin.ca_pem;
    context_.token = admin.token;
    context_.timers = timers_.get();
    context_.steps_per_second = absl::GetFlag(FLAGS_steps_per_second);
    TransportSecurity anonymous;
    anonymous.insecure = !tls;
    anonymous.trusted_ca_pem = admin.ca_pem;
    for (int c = 0; c < 16; ++c) {
      context_.shared_stubs.push_back(v1::Coordinator::NewStub(
          MakeSecureChannel(coordinator.address(), anonymous, kCoordinatorServerName,
                            Connection::kOwn)));
    }
    for (int i = 0; i < n; ++i) workers_.push_back(std::make_unique<FakeWorker>(i, &context_));
  }
  ~Swarm() {
    StopDrivers();
    for (auto& w : workers_) w->Stop();
    // Every callback and stream end touches its worker: wait for them
    // (calls have deadlines of at most 10 s), then stop the timers, whose
    // queued retries touch workers too, and only then free the workers.
    const Clock::time_point stopped = Clock::now();
    while ((context_.calls_in_flight > 0 || context_.streams_open > 0) &&
           SecondsSince(stopped) < 30) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    timers_.reset();
    workers_.clear();
  }

  SwarmContext& context() { return context_; }
  std::vector<std::unique_ptr<FakeWorker>>& workers() { return workers_; }

  // Heartbeats of every joined, live worker once a period (the job's
  // lease / 5, as the coordinator's JoinResponse says), spread over it.
  void StartDrivers(v1::Status::Stub* status_stub) {
    beats_ = std::thread([this] {
      const int64_t period_us = std::max(100, absl::GetFlag(FLAGS_lease_ms) / 5) * int64_t{1000};
      Clock::time_point round = Clock::now();
      while (!stop_) {
        const int n = workers_.size();
        for (int i = 0; i < n && !stop_; ++i) {
          std::this_thread::sleep_until(round + std::chrono::microseconds(period_us * i / n));
          workers_[i]->Heartbeat();
        }
        round += std::chrono::microseconds(period_us);
      }
    });
    statuses_ = std::thread([this, status_stub] {
      while (!stop_) {
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        v1::ClusterStatusRequest request;
        request.set_page_size(50);
        v1::ClusterStatus status;
        const Clock::time_point sent = Clock::now();
        if (status_stub->GetClusterStatus(&context, request, &status).ok()) {
          status_ms_.Add(SecondsSince(sent) * 1000);
          int live = 0;
          for (const auto& [state, count] : status.worker_states()) {
            if (state == "training" || state == "standby") live += count;
          }
          live_members_ = live;
          status_bytes_ = status.ByteSizeLong();
          {
            absl::MutexLock lock(&planning_mu_);
            status_fields_ = LargestFields(status);
          }
          pipelines_ = status.pipelines();
          if (status.prediction().candidates() > 0) {
            absl::MutexLock lock(&planning_mu_);
            planning_[status.epoch()] = {status.prediction().planning_s(),
                                         status.prediction().candidates()};
          }
        }
        absl::SleepFor(absl::Milliseconds(200));
      }
    });
  }
  void StopDrivers() {
    stop_ = true;
    if (beats_.joinable()) beats_.join();
    if (statuses_.joinable()) statuses_.join();
  }
  Latencies& status_ms() { return status_ms_; }
  int live_members() const { return live_members_; }
  size_t status_bytes() const { return status_bytes_; }
  int pipelines() const { return pipelines_; }
  // The planner's wall time of each full plan the status showed (epoch ->
  // seconds, candidates).
  std::map<uint64_t, std::pair<double, int>> planning() {
    absl::MutexLock lock(&planning_mu_);
    return planning_;
  }

  std::string status_fields() {
    absl::MutexLock lock(&planning_mu_);
    return status_fields_;
  }

  // A worker that is live, outside `silenced`, to watch the plans through.
  FakeWorker* Witness(const std::set<std::string>& silenced) {
    for (auto& w : workers_) {
      if (!w->silent() && w->joined() && silenced.count(w->id()) == 0) return w.get();
    }
    return nullptr;
  }

 private:
  std::unique_ptr<Timers> timers_ = std::make_unique<Timers>();
  SwarmContext context_;
  std::vector<std::unique_ptr<FakeWorker>> workers_;
  std::atomic<bool> stop_{false};
  std::thread beats_, statuses_;
  Latencies status_ms_;
  std::atomic<int> live_members_{0}, pipelines_{0};
  std::atomic<size_t> status_bytes_{0};
  absl::Mutex planning_mu_;
  std::map<uint64_t, std::pair<double, int>> planning_ ABSL_GUARDED_BY(planning_mu_);
  std::string status_fields_ ABSL_GUARDED_BY(planning_mu_);
};

// Waits until `witness` has a plan newer than `after_epoch` naming none of
// `gone`; the seconds it took, or -1 after `limit_s`.
double AwaitPlanWithout(FakeWorker* witness, uint64_t after_epoch,
                        const std::set<std::string>& gone, double limit_s) {
  const Clock::time_point start = Clock::now();
  while (witness != nullptr && SecondsSince(start) < limit_s) {
    if (witness->epoch() > after_epoch) {
      bool clear = true;
      for (const std::string& id : witness->plan_members()) clear = clear && !gone.count(id);
      if (clear) return SecondsSince(start);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return -1;
}

Row RunSwarm(int n, const std::string& binary) {
  Row row;
  row.n = n;
  const bool tls = !absl::GetFlag(FLAGS_insecure);
  char dir_template[] = "/tmp/swarm-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  std::vector<std::string> flags = {"--job=" + WriteJob(dir), "--probe_timeout=0",
                                    "--joins_per_minute=100000000",
                                    "--planner=" + absl::GetFlag(FLAGS_planner)};
  if (!tls) flags.push_back("--insecure");
  CoordinatorProcess coordinator(binary, dir, flags);
  if (absl::Status started = coordinator.Start(); !started.ok()) {
    std::fprintf(stderr, "swarm: %s\n", std::string(started.message()).c_str());
    return row;
  }
  absl::StatusOr<Admin> admin = Administer(coordinator, tls);
  if (!admin.ok()) {
    std::fprintf(stderr, "swarm: %s\n", std::string(admin.status().message()).c_str());
    return row;
  }
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(JobText(), "swarm");
  if (!job.ok()) {
    std::fprintf(stderr, "swarm: %s\n", std::string(job.status().message()).c_str());
    return row;
  }
  auto swarm = std::make_unique<Swarm>(n, coordinator, *admin, tls, *job);
  SwarmContext& context = swarm->context();
  auto& workers = swarm->workers();

  // Arrivals, paced; then every worker enrolls (TLS) and joins on its own.
  const Clock::time_point start = Clock::now();
  const int rate = std::max(1, absl::GetFlag(FLAGS_arrivals_per_s));
  swarm->StartDrivers(admin->status.get());
  for (int i = 0; i < n; ++i) {
    std::this_thread::sleep_until(start + std::chrono::microseconds(int64_t{1000000} * i / rate));
    workers[i]->Start();
  }
  while (context.joined < n && SecondsSince(start) < 300) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  row.all_joined_s = context.joined == n ? SecondsSince(start) : -1;
  std::fprintf(stderr, "swarm: %d of %d joined in %.1f s\n", context.joined.load(), n,
               SecondsSince(start));
  // The first plan may come after the last join (the planner waits for
  // measurements); its time is when the first worker saw it.
  auto first_plan_seen = [&context]() -> std::optional<Clock::time_point> {
    absl::MutexLock lock(&context.plans_mu);
    if (context.epoch_first_seen.empty()) return std::nullopt;
    return context.epoch_first_seen.begin()->second;
  };
  while (!first_plan_seen().has_value() && SecondsSince(start) < 300) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (std::optional<Clock::time_point> seen = first_plan_seen()) {
    row.first_plan_s = std::chrono::duration<double>(*seen - start).count();
  }
  row.enrolled = context.enrolled;
  row.joined = context.joined;
  row.enroll_errors = context.enroll_errors;
  row.join_errors = context.join_errors;
  row.enroll_p50 = context.enroll_ms.Quantile(0.5);
  row.enroll_p99 = context.enroll_ms.Quantile(0.99);
  row.join_p50 = context.join_ms.Quantile(0.5);
  row.join_p99 = context.join_ms.Quantile(0.99);

  // The steady window.
  absl::SleepFor(absl::Seconds(3));
  context.heartbeat_ms.Clear();
  swarm->status_ms().Clear();
  const uint64_t plans_before = context.plans_received;
  const uint64_t events_before = FileSize(coordinator.state_dir() + "/events.log");
  const uint64_t metrics_before = FileSize(coordinator.state_dir() + "/metrics.jsonl");
  const ProcStat before = coordinator.Stat();
  const Clock::time_point steady = Clock::now();
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_steady_s)));
  const ProcStat after = coordinator.Stat();
  const double minutes = SecondsSince(steady) / 60;
  row.cpu_cores = (after.cpu_s - before.cpu_s) / SecondsSince(steady);
  row.rss_mib = after.rss_mib;
  row.rss_kib_per_member = after.rss_mib * 1024 / n;
  row.threads = after.threads;
  row.hb_p50 = context.heartbeat_ms.Quantile(0.5);
  row.hb_p99 = context.heartbeat_ms.Quantile(0.99);
  row.status_p50 = swarm->status_ms().Quantile(0.5);
  row.status_p99 = swarm->status_ms().Quantile(0.99);
  row.status_bytes = swarm->status_bytes();
  row.status_fields = swarm->status_fields();
  row.members = swarm->live_members();
  row.pipelines = swarm->pipelines();
  for (const auto& [epoch, planned] : swarm->planning()) {
    if (planned.first > row.planning_s) {
      row.planning_s = planned.first;
      row.planning_candidates = planned.second;
    }
  }
  row.plans_per_worker_minute = (context.plans_received - plans_before) / minutes / n;
  row.events_bytes_per_minute =
      (FileSize(coordinator.state_dir() + "/events.log") - events_before) / minutes;
  row.metrics_bytes_per_minute =
      (FileSize(coordinator.state_dir() + "/metrics.jsonl") - metrics_before) / minutes;
  row.heartbeat_errors = context.heartbeat_errors;
  row.plan_streams_opened = context.plan_streams_opened;
  std::tie(row.bench_fds, row.bench_fd_limit) = OpenDescriptors();
  row.enroll_codes = context.errors.Summary("Enroll");
  row.join_codes = context.errors.Summary("Join");
  row.heartbeat_codes = context.errors.Summary("Heartbeat");
  row.checkpoint_codes = context.errors.Summary("SaveCheckpoint");
  row.checkpoints_saved = context.checkpoints_saved;
  row.checkpoint_errors = context.checkpoint_errors;
  row.checkpoint_bytes = context.checkpoint_bytes;
  row.checkpoint_p50 = context.checkpoint_ms.Quantile(0.5);
  row.checkpoint_p99 = context.checkpoint_ms.Quantile(0.99);

  // 10% of the members go silent at once, the plan's own among them.
  std::set<std::string> silenced;
  FakeWorker* observer = swarm->Witness({});
  const std::set<std::string> planned =
      observer != nullptr ? observer->plan_members() : std::set<std::string>();
  const uint64_t epoch_before = observer != nullptr ? observer->epoch() : 0;
  for (auto& w : workers) {
    if (static_cast<int>(silenced.size()) >= std::max(1, n / 10)) break;
    if (planned.count(w->id()) > 0 || w->index() % 10 == 0) {
      w->Silence();
      silenced.insert(w->id());
    }
  }
  context.plan_fanout_ms.Clear();
  row.replan_s = AwaitPlanWithout(swarm->Witness(silenced), epoch_before, silenced,
                                  30 + 2 * absl::GetFlag(FLAGS_lease_ms) / 1000.0);
  absl::SleepFor(absl::Seconds(2));  // the plan reaches everyone
  row.fanout_p50 = context.plan_fanout_ms.Quantile(0.5);
  row.fanout_p99 = context.plan_fanout_ms.Quantile(0.99);

  if (absl::GetFlag(FLAGS_restart)) {
    absl::SleepFor(absl::Seconds(3));  // the state after the re-plan is written
    row.step_before = context.newest_step;
    const int live_before = swarm->live_members();
    coordinator.Kill();
    const Clock::time_point killed = Clock::now();
    if (absl::Status started = coordinator.Start(); !started.ok()) {
      std::fprintf(stderr, "swarm: restart: %s\n", std::string(started.message()).c_str());
    } else {
      const Clock::time_point restarted = Clock::now();
      std::fprintf(stderr, "swarm: coordinator restarted in %.1f s\n", SecondsSince(killed));
      while (SecondsSince(restarted) < 120) {
        int attached = 0, live = 0;
        for (auto& w : workers) {
          if (w->silent()) continue;
          ++live;
          attached += w->AttachedSince(restarted) ? 1 : 0;
        }
        row.reattached = attached;
        row.reattach_live = live;
        if (row.reattach_99_s < 0 && attached >= 0.99 * live) {
          row.reattach_99_s = SecondsSince(restarted);
        }
        if (attached == live) {
          row.reattach_s = SecondsSince(restarted);
          break;
        }
        absl::SleepFor(absl::Milliseconds(50));
      }
      absl::SleepFor(absl::Seconds(3));
      row.members_after_restart = swarm->live_members();
      row.step_after = context.newest_step;
      std::fprintf(stderr, "swarm: live members %d before the kill, %d after; steps %d -> %d\n",
                   live_before, row.members_after_restart, row.step_before, row.step_after);
    }
  }

  if (absl::GetFlag(FLAGS_churn_s) > 0) {
    // Each second: 1% of the live workers die (they come back as new
    // members after 20 s), 1% pause for 2 s (within the lease), and the
    // silenced of the mass failure return a few at a time.
    std::mt19937 random(absl::GetFlag(FLAGS_seed));
    std::vector<std::pair<Clock::time_point, FakeWorker*>> returns;
    const uint64_t plans_at_start = context.plans_received;
    const uint64_t epoch_at_start = swarm->Witness({}) ? swarm->Witness({})->epoch() : 0;
    const Clock::time_point churn = Clock::now();
    while (SecondsSince(churn) < absl::GetFlag(FLAGS_churn_s)) {
      for (int k = 0; k < std::max(1, n / 100); ++k) {
        FakeWorker* w = workers[random() % n].get();
        if (w->silent()) continue;
        w->Silence();
        if (random() % 2 == 0) {
          ++row.churn_deaths;
          returns.push_back({Clock::now() + std::chrono::seconds(20), w});
        } else {
          ++row.churn_pauses;
          returns.push_back({Clock::now() + std::chrono::seconds(2), w});
        }
      }
      absl::SleepFor(absl::Seconds(1));
      for (auto it = returns.begin(); it != returns.end();) {
        if (it->first <= Clock::now()) {
          it->second->Revive();
          it = returns.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& [when, w] : returns) w->Revive();
    absl::SleepFor(absl::Seconds(8));
    FakeWorker* witness = swarm->Witness({});
    row.churn_plans = witness != nullptr ? static_cast<int>(witness->epoch() - epoch_at_start) : 0;
    row.churn_members = swarm->live_members();
    (void)plans_at_start;
  }

  swarm.reset();
  coordinator.Terminate();
  return row;
}

}  // namespace
}  // namespace geotrain::swarm

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // As in the coordinator: Debian's abseil checks lock order on every
  // acquisition, in a graph of every mutex (here 10,000 workers' own), 15%
  // of this process's CPU at 10,000 workers.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  using geotrain::swarm::Row;
  // A descriptor per worker (its channel; enrollment shares 16), here and
  // in the coordinator, which inherits the limit.
  // At 10,000 workers the default hard limit (20,000 here) ran out: the
  // bench could not open /proc to read the coordinator's figures. Root may
  // raise it; anyone else gets the hard limit.
  rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
    const rlim_t wanted = std::max<rlim_t>(files.rlim_max, 65536);
    rlimit raised{wanted, wanted};
    if (setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      files.rlim_cur = files.rlim_max;
      setrlimit(RLIMIT_NOFILE, &files);
    }
  }
  signal(SIGPIPE, SIG_IGN);
  std::string bin = absl::GetFlag(FLAGS_coordinator_bin);
  if (bin.empty()) {
    char self[4096];
    const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    self[len > 0 ? len : 0] = '\0';
    std::string dir(self);
    dir = dir.substr(0, dir.rfind('/'));
    bin = dir + "/../bin/geotrain-coordinator";
  }
  if (access(bin.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "swarm: no coordinator at %s (--coordinator_bin)\n", bin.c_str());
    return 2;
  }
  std::vector<int> sizes;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_workers), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 5 || n > 10000) {
      std::fprintf(stderr, "swarm: --workers wants sizes of 5 to 10000, not '%s'\n",
                   std::string(part).c_str());
      return 2;
    }
    if (n + 500 > static_cast<int>(files.rlim_cur)) {
      std::fprintf(stderr, "swarm: %d workers need about %d file descriptors; the limit is %d\n",
                   n, n + 500, static_cast<int>(files.rlim_cur));
      return 2;
    }
    sizes.push_back(n);
  }
  const bool tls = !absl::GetFlag(FLAGS_insecure);
  std::printf("swarm: fake workers over loopback against %s (%s, --planner=%s, lease %d ms, "
              "a heartbeat every %d ms)\n",
              bin.c_str(), tls ? "TLS, a certificate per worker" : "insecure",
              absl::GetFlag(FLAGS_planner).c_str(), absl::GetFlag(FLAGS_lease_ms),
              std::max(100, absl::GetFlag(FLAGS_lease_ms) / 5));
  for (int n : sizes) {
    std::fprintf(stderr, "swarm: %d workers...\n", n);
    const Row r = geotrain::swarm::RunSwarm(n, bin);
    std::printf("\n== %d workers\n", r.n);
    if (tls) {
      std::printf("  enrolled %d (failed attempts, retried: %d%s%s%s), enroll p50 %.1f ms p99 "
                  "%.1f ms\n",
                  r.enrolled, r.enroll_errors, r.enroll_codes.empty() ? "" : ": ",
                  r.enroll_codes.c_str(), "", r.enroll_p50, r.enroll_p99);
    }
    std::printf("  joined %d (failed attempts, retried: %d%s%s) in %.1f s, join p50 %.1f ms p99 "
                "%.1f ms; members the coordinator counts: %d\n",
                r.joined, r.join_errors, r.join_codes.empty() ? "" : ": ", r.join_codes.c_str(),
                r.all_joined_s, r.join_p50, r.join_p99, r.members);
    std::printf("  first plan at %.1f s; pipelines %d; the planner took %.3f s over %d workers\n",
                r.first_plan_s, r.pipelines, r.planning_s, r.planning_candidates);
    std::printf("  heartbeats failed (whole run): %d%s%s; plan streams opened: %d\n",
                r.heartbeat_errors, r.heartbeat_codes.empty() ? "" : ": ",
                r.heartbeat_codes.c_str(), r.plan_streams_opened);
    std::printf("  heartbeat p50 %.1f ms p99 %.1f ms; status (first page) p50 %.1f ms p99 %.1f ms, "
                "%zu bytes (largest: %s)\n",
                r.hb_p50, r.hb_p99, r.status_p50, r.status_p99, r.status_bytes,
                r.status_fields.c_str());
    std::printf("  coordinator: %.2f cores, RSS %.0f MiB (%.0f KiB per member), %d threads; "
                "this bench: %d descriptors open of %d\n",
                r.cpu_cores, r.rss_mib, r.rss_kib_per_member, r.threads, r.bench_fds,
                r.bench_fd_limit);
    std::printf("  plan messages per worker per minute: %.2f; events log: %.0f bytes/min; "
                "metrics log: %.0f bytes/min\n",
                r.plans_per_worker_minute, r.events_bytes_per_minute, r.metrics_bytes_per_minute);
    std::printf("  checkpoints: %llu uploads by the stages' primaries so far, %.1f KiB each, "
                "p50 %.1f ms p99 %.1f ms; %llu refused or failed%s%s\n",
                static_cast<unsigned long long>(r.checkpoints_saved),
                r.checkpoints_saved > 0 ? r.checkpoint_bytes / 1024.0 / r.checkpoints_saved : 0.0,
                r.checkpoint_p50, r.checkpoint_p99,
                static_cast<unsigned long long>(r.checkpoint_errors),
                r.checkpoint_codes.empty() ? "" : ": ", r.checkpoint_codes.c_str());
    std::printf("  10%% silent at once -> plan without them in %.1f s; plan fan-out p50 %.0f ms "
                "p99 %.0f ms\n",
                r.replan_s, r.fanout_p50, r.fanout_p99);
    if (absl::GetFlag(FLAGS_restart)) {
      std::printf("  kill -9 and restart: every live member re-attached in %.1f s; members %d; "
                  "step %d before, %d after\n",
                  r.reattach_s, r.members_after_restart, r.step_before, r.step_after);
      std::printf("    (99%% in %.1f s; %d of %d live members re-attached when the wait ended, "
                  "at most 120 s)\n",
                  r.reattach_99_s, r.reattached, r.reattach_live);
    }
    if (absl::GetFlag(FLAGS_churn_s) > 0) {
      std::printf("  churn %d s: %d deaths, %d pauses, %d plans; members at the end %d\n",
                  absl::GetFlag(FLAGS_churn_s), r.churn_deaths, r.churn_pauses, r.churn_plans,
                  r.churn_members);
    }
    std::fflush(stdout);
  }
  return 0;
}
