// A simulated swarm over the real protocol: N fake workers in this one
// process join a real geotrain-coordinator (its own process, on loopback),
// each with its own session, heartbeat at the real period, and hold a
// WatchPlan stream, all on gRPC's callback API (no thread per worker).
// It prints, for each N: joins (p50/p99 latency, time until all joined,
// members the coordinator counts), Heartbeat and first-page Status
// latency, the time to the first plan, the coordinator's CPU, RSS and
// threads from /proc while the swarm heartbeats, and the time from 10% of
// the members going silent at once to a plan without them.
//
// Run: build/bench/swarm [--workers=100,1000] [--steady_s=20]
//
// Not yet (issue 34): TLS with a certificate per worker, speed classes and
// region links in the heartbeats, fake stages that report steps and upload
// checkpoints, a churn script, N = 10,000. The coordinator runs insecure
// with --probe_timeout=0 (the fake addresses serve nothing), the join-order
// planner and a lifted join limit.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/join_token.h"
#include "common/rpc_options.h"
#include "geotrain/v1/coordinator.grpc.pb.h"
#include "geotrain/v1/status.grpc.pb.h"

ABSL_FLAG(std::string, workers, "100,1000", "swarm sizes, comma-separated");
ABSL_FLAG(std::string, coordinator_bin, "", "geotrain-coordinator (default: next to this bench)");
ABSL_FLAG(int, steady_s, 20, "seconds of heartbeats measured once all have joined");
ABSL_FLAG(int, joins_in_flight, 64, "joins outstanding at once (workers arriving)");

namespace geotrain {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Latencies in ms, thread-safe.
class Latencies {
 public:
  void Add(double ms) {
    absl::MutexLock lock(&mu_);
    ms_.push_back(ms);
  }
  double Quantile(double q) {
    absl::MutexLock lock(&mu_);
    if (ms_.empty()) return 0;
    std::vector<double> sorted = ms_;
    std::sort(sorted.begin(), sorted.end());
    return sorted[std::min(sorted.size() - 1, static_cast<size_t>(q * sorted.size()))];
  }
  size_t size() {
    absl::MutexLock lock(&mu_);
    return ms_.size();
  }
  void Clear() {
    absl::MutexLock lock(&mu_);
    ms_.clear();
  }

 private:
  absl::Mutex mu_;
  std::vector<double> ms_ ABSL_GUARDED_BY(mu_);
};

struct ProcStat {
  double cpu_s = 0;
  double rss_mib = 0;
  int threads = 0;
};

ProcStat ReadProc(pid_t pid) {
  ProcStat out;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), {});
  // Fields after the ")" of the command: state is 3rd, utime 14th, stime 15th.
  const size_t close = text.rfind(')');
  if (close != std::string::npos) {
    std::vector<std::string> fields = absl::StrSplit(text.substr(close + 2), ' ');
    if (fields.size() > 13) {
      double utime = 0, stime = 0;
      (void)absl::SimpleAtod(fields[11], &utime);
      (void)absl::SimpleAtod(fields[12], &stime);
      out.cpu_s = (utime + stime) / sysconf(_SC_CLK_TCK);
    }
  }
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) out.rss_mib = std::stod(line.substr(6)) / 1024;
    if (line.rfind("Threads:", 0) == 0) out.threads = std::stoi(line.substr(8));
  }
  return out;
}

// One fake worker: its join, its lease, its plan stream.
struct FakeWorker {
  int index = 0;
  std::string name, session, id;
  v1::Coordinator::Stub* stub = nullptr;
  std::atomic<bool> joined{false}, silent{false};
  std::atomic<uint64_t> epoch{0};
  absl::Mutex mu;
  std::set<std::string> plan_members ABSL_GUARDED_BY(mu);
};

// The WatchPlan stream of one fake worker (owned by the swarm; cancelled
// at the end).
class PlanReader : public grpc::ClientReadReactor<v1::Plan> {
 public:
  PlanReader(FakeWorker* worker, std::function<void(FakeWorker*, uint64_t)> on_plan)
      : worker_(worker), on_plan_(std::move(on_plan)) {
    request_.set_worker_id(worker->id);
    worker->stub->async()->WatchPlan(&context_, &request_, this);
    StartRead(&plan_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    {
      absl::MutexLock lock(&worker_->mu);
      worker_->plan_members.clear();
      for (const v1::StageAssignment& s : plan_.stages()) {
        worker_->plan_members.insert(s.worker_id());
        for (const auto& r : s.replicas()) worker_->plan_members.insert(r.worker_id());
      }
    }
    worker_->epoch = plan_.epoch();
    on_plan_(worker_, plan_.epoch());
    StartRead(&plan_);
  }
  void OnDone(const grpc::Status&) override { done_ = true; }
  void Cancel() { context_.TryCancel(); }
  bool done() const { return done_; }

 private:
  FakeWorker* worker_;
  std::function<void(FakeWorker*, uint64_t)> on_plan_;
  grpc::ClientContext context_;
  v1::WatchPlanRequest request_;
  v1::Plan plan_;
  std::atomic<bool> done_{false};
};

struct Row {
  int n = 0, joined = 0, members = 0;
  double join_p50 = 0, join_p99 = 0, all_joined_s = 0;
  double hb_p50 = 0, hb_p99 = 0, status_p50 = 0, status_p99 = 0;
  double first_plan_s = -1, cpu_cores = 0, rss_mib = 0;
  int threads = 0, join_errors = 0;
  double replan_s = -1;
};

std::string WriteJob(const std::string& dir) {
  const std::string path = dir + "/swarm.textproto";
  std::ofstream(path) << "name: \"swarm\"\n"
                         "gpt { context: 8 d_model: 16 heads: 2 blocks: 2 }\n"
                         "text {}\nsteps: 1000000\nmin_workers: 4\nlease_ms: 5000\n";
  return path;
}

Row RunSwarm(int n, const std::string& coordinator_bin) {
  Row row;
  row.n = n;
  char dir_template[] = "/tmp/swarm-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string job = WriteJob(dir);
  const std::string port_file = dir + "/port";
  std::fflush(stdout);  // the child must not repeat what is buffered
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string log = dir + "/coordinator.log";
    freopen(log.c_str(), "w", stderr);
    freopen(log.c_str(), "a", stdout);
    execl(coordinator_bin.c_str(), coordinator_bin.c_str(), ("--job=" + job).c_str(),
          ("--state_dir=" + dir + "/state").c_str(), "--listen=127.0.0.1:0",
          ("--port_file=" + port_file).c_str(), "--insecure", "--probe_timeout=0",
          "--planner=join-order", "--joins_per_minute=10000000", nullptr);
    _exit(127);
  }
  std::string port;
  for (int i = 0; i < 300 && port.empty(); ++i) {
    std::ifstream in(port_file);
    std::getline(in, port);
    if (port.empty()) absl::SleepFor(absl::Milliseconds(100));
  }
  if (port.empty()) {
    std::fprintf(stderr, "swarm: the coordinator did not start (see %s/coordinator.log)\n",
                 dir.c_str());
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return row;
  }
  const std::string target = "127.0.0.1:" + port;
  // Several connections, as many hosts would have.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs;
  for (int c = 0; c < 16; ++c) {
    grpc::ChannelArguments args;
    args.SetInt("swarm.connection", c);  // distinct channels, distinct connections
    channels.push_back(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
    stubs.push_back(v1::Coordinator::NewStub(channels.back()));
  }
  auto status_stub = v1::Status::NewStub(channels[0]);

  std::vector<std::unique_ptr<FakeWorker>> workers;
  for (int i = 0; i < n; ++i) {
    auto w = std::make_unique<FakeWorker>();
    w->index = i;
    w->name = absl::StrCat("fake-", i);
    w->session = RandomHexSecret(8);
    w->stub = stubs[i % stubs.size()].get();
    workers.push_back(std::move(w));
  }
  // Plan delivery: the first plan seen by anyone, and each epoch's arrival.
  const Clock::time_point start = Clock::now();
  std::atomic<double> first_plan_s{-1};
  std::vector<std::unique_ptr<PlanReader>> readers;
  absl::Mutex readers_mu;
  auto on_plan = [&](FakeWorker*, uint64_t) {
    double expected = -1;
    first_plan_s.compare_exchange_strong(expected, Since(start));
  };

  // Joins: `joins_in_flight` at a time; a failed attempt is retried with
  // the same session after a jittered pause.
  Latencies join_ms;
  std::atomic<int> joined{0}, join_errors{0}, in_flight{0}, next{0};
  const int window = absl::GetFlag(FLAGS_joins_in_flight);
  std::function<void(FakeWorker*)> join = [&](FakeWorker* w) {
    auto context = std::make_shared<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    auto request = std::make_shared<v1::JoinRequest>();
    request->set_name(w->name);
    request->set_address(absl::StrCat("192.0.2.", 1 + w->index % 250, ":", 7000 + w->index));
    request->set_session_id(w->session);
    request->mutable_device()->set_device("cpu");
    request->mutable_device()->set_matmul_gflops(10 + w->index % 3 * 10);
    auto response = std::make_shared<v1::JoinResponse>();
    const Clock::time_point sent = Clock::now();
    w->stub->async()->Join(
        context.get(), request.get(), response.get(),
        [&, w, context, request, response, sent](grpc::Status status) {
          if (status.ok()) {
            join_ms.Add(Since(sent) * 1000);
            w->id = response->worker_id();
            w->joined = true;
            ++joined;
            --in_flight;
            auto reader = std::make_unique<PlanReader>(w, on_plan);
            absl::MutexLock lock(&readers_mu);
            readers.push_back(std::move(reader));
            return;
          }
          ++join_errors;
          // Retried from the driver loop below.
          std::thread([&, w] {
            absl::SleepFor(Jittered(absl::Seconds(1)));
            join(w);
          }).detach();
        });
  };
  while (joined < n && Since(start) < 120) {
    while (next < n && in_flight < window) {
      ++in_flight;
      join(workers[next++].get());
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  row.all_joined_s = joined == n ? Since(start) : -1;
  row.joined = joined;
  row.join_errors = join_errors;
  row.join_p50 = join_ms.Quantile(0.5);
  row.join_p99 = join_ms.Quantile(0.99);

  // Heartbeats: each worker once a second, spread over the second.
  Latencies heartbeat_ms, status_ms;
  std::atomic<bool> stop{false};
  std::atomic<int> live_members{0};
  std::thread beats([&] {
    Clock::time_point round = Clock::now();
    while (!stop) {
      for (int i = 0; i < n && !stop; ++i) {
        FakeWorker* w = workers[i].get();
        const Clock::time_point due =
            round + std::chrono::microseconds(static_cast<int64_t>(1e6 * i / n));
        std::this_thread::sleep_until(due);
        if (!w->joined || w->silent) continue;
        auto context = std::make_shared<grpc::ClientContext>();
        context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        auto request = std::make_shared<v1::HeartbeatRequest>();
        request->set_worker_id(w->id);
        request->set_epoch(w->epoch);
        auto response = std::make_shared<v1::HeartbeatResponse>();
        const Clock::time_point sent = Clock::now();
        w->stub->async()->Heartbeat(context.get(), request.get(), response.get(),
                                    [&, context, request, response, sent](grpc::Status s) {
                                      if (s.ok()) heartbeat_ms.Add(Since(sent) * 1000);
                                    });
      }
      round += std::chrono::seconds(1);
    }
  });
  std::thread statuses([&] {
    while (!stop) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      v1::ClusterStatusRequest request;
      request.set_page_size(50);
      v1::ClusterStatus status;
      const Clock::time_point sent = Clock::now();
      if (status_stub->GetClusterStatus(&context, request, &status).ok()) {
        status_ms.Add(Since(sent) * 1000);
        int live = 0;
        for (const auto& [state, count] : status.worker_states()) {
          if (state == "training" || state == "standby") live += count;
        }
        live_members = live;
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
  });
  // The steady window: heartbeats of everyone, status polled.
  absl::SleepFor(absl::Seconds(2));
  heartbeat_ms.Clear();
  status_ms.Clear();
  const ProcStat before = ReadProc(pid);
  const Clock::time_point steady = Clock::now();
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_steady_s)));
  const ProcStat after = ReadProc(pid);
  row.cpu_cores = (after.cpu_s - before.cpu_s) / Since(steady);
  row.rss_mib = after.rss_mib;
  row.threads = after.threads;
  row.hb_p50 = heartbeat_ms.Quantile(0.5);
  row.hb_p99 = heartbeat_ms.Quantile(0.99);
  row.status_p50 = status_ms.Quantile(0.5);
  row.status_p99 = status_ms.Quantile(0.99);
  row.first_plan_s = first_plan_s;
  row.members = live_members;

  // 10% of the members go silent at once, the plan's own among them.
  std::set<std::string> silenced;
  std::set<std::string> planned;
  {
    absl::MutexLock lock(&workers[0]->mu);
    planned = workers[0]->plan_members;
  }
  for (int i = 0; i < n && static_cast<int>(silenced.size()) < std::max(1, n / 10); ++i) {
    FakeWorker* w = workers[i].get();
    if (planned.count(w->id) > 0 || i % 10 == 0) {
      w->silent = true;
      silenced.insert(w->id);
    }
  }
  const Clock::time_point silence = Clock::now();
  FakeWorker* witness = nullptr;
  for (auto& w : workers) {
    if (!w->silent) {
      witness = w.get();
      break;
    }
  }
  while (Since(silence) < 60 && witness != nullptr) {
    bool clear = true;
    {
      absl::MutexLock lock(&witness->mu);
      for (const std::string& id : witness->plan_members) clear = clear && !silenced.count(id);
    }
    if (clear && witness->epoch > 1) {
      row.replan_s = Since(silence);
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  stop = true;
  beats.join();
  statuses.join();
  {
    absl::MutexLock lock(&readers_mu);
    for (auto& r : readers) r->Cancel();
  }
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  absl::SleepFor(absl::Milliseconds(500));  // the readers' OnDone
  return row;
}

}  // namespace
}  // namespace geotrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
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
    if (!absl::SimpleAtoi(part, &n) || n < 5 || n > 20000) {
      std::fprintf(stderr, "swarm: --workers wants sizes of 5 to 20000, not '%s'\n",
                   std::string(part).c_str());
      return 2;
    }
    sizes.push_back(n);
  }
  std::printf("swarm: fake workers over loopback against %s (insecure, join-order)\n",
              bin.c_str());
  std::printf("%7s %7s %8s %11s %11s %9s %9s %10s %10s %10s %10s %9s %8s %8s %10s\n",
              "workers", "joined", "members", "join p50ms", "join p99ms", "all in s",
              "join errs", "hb p50ms", "hb p99ms", "status p50", "status p99", "1st plan",
              "cores", "RSS MiB", "10% lost");
  for (int n : sizes) {
    std::fprintf(stderr, "swarm: %d workers...\n", n);
    const geotrain::Row r = geotrain::RunSwarm(n, bin);
    std::printf("%7d %7d %8d %11.1f %11.1f %9.1f %9d %10.1f %10.1f %10.1f %10.1f %8.1fs %8.2f "
                "%8.0f %9.1fs  threads %d\n",
                r.n, r.joined, r.members, r.join_p50, r.join_p99, r.all_joined_s, r.join_errors,
                r.hb_p50, r.hb_p99, r.status_p50, r.status_p99, r.first_plan_s, r.cpu_cores,
                r.rss_mib, r.replan_s, r.threads);
    std::fflush(stdout);
  }
  return 0;
}
