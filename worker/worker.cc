#include "worker/worker.h"

#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/job_spec.h"
#include "common/logging.h"
#include "common/process_stats.h"
#include "common/rpc_options.h"
#include "common/status_macros.h"
#include "worker/device_probe.h"
#include "worker/pipeline_driver.h"
#include "worker/stage_runtime.h"

namespace geotrain {
namespace {

// Splits "host:port" / "[v6]:port" at the last colon.
std::pair<std::string, std::string> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return {address, ""};
  return {address.substr(0, colon), address.substr(colon + 1)};
}

bool IsHostPort(const std::string& address) {
  auto [host, port] = SplitHostPort(address);
  int number = 0;
  return !host.empty() && absl::SimpleAtoi(port, &number) && number > 0 && number < 65536;
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> ParseLinkRoutes(const std::string& spec) {
  std::map<std::string, std::string> routes;
  for (absl::string_view entry : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    std::vector<std::string> parts = absl::StrSplit(entry, '=');
    if (parts.size() != 2 || !IsHostPort(parts[0]) || !IsHostPort(parts[1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("route '", entry, "' is not PEER_HOST:PORT=VIA_HOST:PORT"));
    }
    if (!routes.emplace(parts[0], parts[1]).second) {
      return absl::InvalidArgumentError(absl::StrCat("two routes for peer ", parts[0]));
    }
  }
  return routes;
}

Worker::Worker(WorkerOptions options)
    : options_(std::move(options)), coordinator_(options_.coordinator) {}

Worker::~Worker() {
  Stop();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  if (watch_thread_.joinable()) watch_thread_.join();
  if (server_) server_->Shutdown(DeadlineFromNow(std::chrono::milliseconds(1000)));
}

void Worker::Stop() {
  stop_ = true;
  inbox_.Close();
  link_server_.Shutdown();
  absl::MutexLock lock(&mu_);
  if (watch_context_) watch_context_->TryCancel();
  if (downstream_ != nullptr) downstream_->Cancel();
}

absl::Status Worker::StartServer() {
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(&builder);
  int port = 0;
  builder.AddListeningPort(options_.listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&link_server_);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen));
  }
  std::string host = SplitHostPort(options_.listen).first;
  std::string advertised_port = std::to_string(port);
  if (!options_.advertise.empty()) {
    // HOST or HOST:PORT (a bracketed IPv6 host has no port after its ']').
    auto [adv_host, adv_port] = SplitHostPort(options_.advertise);
    const bool has_port = !adv_port.empty() && adv_port.find(']') == std::string::npos &&
                          options_.advertise.back() != ']';
    host = has_port ? adv_host : options_.advertise;
    if (has_port) advertised_port = adv_port;
  } else if (host == "0.0.0.0" || host == "[::]" || host.empty()) {
    char hostname[256] = {0};
    gethostname(hostname, sizeof(hostname) - 1);
    host = hostname;
  }
  advertise_ = absl::StrCat(host, ":", advertised_port);
  GT_LOG(Info) << "stage service on port " << port << ", advertised as " << advertise_;
  return absl::OkStatus();
}

absl::Status Worker::Run() {
  ASSIGN_OR_RETURN(v1::DeviceInfo device, ProbeDevice(options_.device, options_.threads));
  GT_LOG(Info) << "device " << device.device() << ", " << device.threads()
               << " thread(s), matmul " << device.matmul_gflops() << " GFLOP/s";
  device_name_ = device.device();
  RETURN_IF_ERROR(StartServer());

  v1::JoinRequest join;
  join.set_name(options_.name);
  join.set_address(advertise_);
  *join.mutable_device() = device;
  ASSIGN_OR_RETURN(v1::JoinResponse joined,
                   coordinator_.JoinWithRetry(join, stop_, options_.join_timeout));
  worker_id_ = joined.worker_id();
  job_ = joined.job();
  GT_LOG(Info) << "joined " << coordinator_.address() << " as " << worker_id_
               << " for job " << job_.name();

  heartbeat_thread_ = std::thread([this, ms = joined.heartbeat_ms()] { HeartbeatLoop(ms); });
  watch_thread_ = std::thread([this] { WatchLoop(); });

  std::optional<v1::Plan> plan = WaitForAssignment();
  if (!plan.has_value()) {
    coordinator_.Leave();
    return stop_ ? absl::CancelledError("stopped") : absl::OkStatus();
  }
  for (const v1::StageAssignment& stage : plan->stages()) {
    if (stage.worker_id() == worker_id_) {
      absl::Status trained = Train(*plan, stage);
      if (!trained.ok()) {
        GT_LOG(Error) << "stage " << stage.stage() << " failed: " << trained.message();
        coordinator_.Leave();
      }
      return trained;
    }
  }
  return absl::InternalError("assignment vanished");
}

std::optional<v1::Plan> Worker::WaitForAssignment() {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stop_ || watch_ended_) return true;
    if (!latest_plan_.has_value()) return false;
    if (latest_plan_->job_done()) return true;
    for (const v1::StageAssignment& s : latest_plan_->stages()) {
      if (s.worker_id() == worker_id_) return true;
    }
    return false;
  };
  bool announced = false;
  while (!mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(1))) {
    if (latest_plan_.has_value() && !announced) {
      GT_LOG(Info) << "standby: the plan of epoch " << latest_plan_->epoch()
                   << " has no stage for this worker";
      announced = true;
    }
  }
  if (stop_ || !latest_plan_.has_value() || latest_plan_->job_done()) return std::nullopt;
  return latest_plan_;
}

absl::Status Worker::Train(const v1::Plan& plan, const v1::StageAssignment& mine) {
  const int num_stages = plan.stages_size();
  GT_LOG(Info) << "stage " << mine.stage() << "/" << num_stages << ": layers ["
               << mine.layer_begin() << "," << mine.layer_end() << "), epoch "
               << plan.epoch();
  StagePlacement placement{mine.stage(), num_stages, mine.layer_begin(), mine.layer_end()};
  const ScheduleConfig schedule = ConfigureSchedule(job_, num_stages);
  RuntimeOptions runtime_options;
  runtime_options.device = device_name_;
  runtime_options.max_weight_versions = schedule.max_weight_versions;
  for (auto [encoding, codec] : {std::pair{&runtime_options.activation_encoding, job_.activation_codec()},
                                 std::pair{&runtime_options.gradient_encoding, job_.gradient_codec()}}) {
    encoding->codec = codec;
    encoding->block_size = job_.codec_block_size();
    encoding->topk_fraction = job_.topk_fraction();
    encoding->zstd = job_.zstd();
  }
  ASSIGN_OR_RETURN(std::unique_ptr<StageRuntime> runtime,
                   StageRuntime::Create(job_, placement, runtime_options));
  auto validator = std::make_shared<const LinkValidator>(
      job_, plan.epoch(), mine.stage(), mine.layer_begin(), mine.layer_end());
  coordinator_.SetEpoch(plan.epoch());
  link_server_.Activate(validator, &inbox_);

  std::unique_ptr<DownstreamLinkClient> downstream;
  if (mine.stage() + 1 < num_stages) {
    const v1::StageAssignment& next = plan.stages(mine.stage() + 1);
    std::string dial = next.address();
    if (auto route = options_.routes.find(dial); route != options_.routes.end()) {
      dial = route->second;
      GT_LOG(Info) << "routing the link to " << next.address() << " via " << dial;
    }
    ASSIGN_OR_RETURN(downstream,
                     DownstreamLinkClient::Connect(dial, validator, &inbox_,
                                                   absl::Seconds(120), &stop_));
    absl::MutexLock lock(&mu_);
    downstream_ = downstream.get();
    if (stop_) downstream_->Cancel();
  }
  // Unregisters the link before it is destroyed, whatever the exit path;
  // on errors, closing the inbox first lets its reader thread finish.
  struct Unregister {
    Worker* worker;
    ~Unregister() {
      worker->inbox_.Close();
      absl::MutexLock lock(&worker->mu_);
      worker->downstream_ = nullptr;
    }
  } unregister{this};
  PipelineDriverOptions driver_options;
  driver_options.epoch = plan.epoch();
  driver_options.stage = mine.stage();
  driver_options.num_stages = num_stages;
  driver_options.start_step = plan.start_step();
  driver_options.schedule = schedule;
  if (mine.stage() > 0) driver_options.upstream_peer = plan.stages(mine.stage() - 1).address();
  if (mine.stage() + 1 < num_stages) {
    driver_options.downstream_peer = plan.stages(mine.stage() + 1).address();
  }
  GT_LOG(Info) << "schedule " << ScheduleName(job_.schedule()) << ": window " << schedule.window
               << ", update every " << schedule.update_every << " backward(s)"
               << (schedule.flush ? ", flush each step" : ", no flush");
  PipelineDriver driver(job_, driver_options, runtime.get(),
                        mine.stage() > 0 ? &link_server_ : nullptr, downstream.get(),
                        &inbox_, &coordinator_, &stats_);
  RETURN_IF_ERROR(driver.Run());
  if (downstream) {
    absl::Status closed = downstream->Close();
    if (!closed.ok()) GT_LOG(Warning) << "closing downstream link: " << closed.message();
  }
  GT_LOG(Info) << "stage " << mine.stage() << " finished " << job_.steps() << " steps";
  // A last heartbeat so that the status shows the final step and memory.
  (void)coordinator_.Heartbeat(ResidentBytes(), stats_.Get());
  RETURN_IF_ERROR(coordinator_.ReportDone(job_.steps()));
  return absl::OkStatus();
}

void Worker::HeartbeatLoop(int interval_ms) {
  while (!stop_) {
    absl::StatusOr<bool> known = coordinator_.Heartbeat(ResidentBytes(), stats_.Get());
    if (!known.ok()) {
      GT_LOG(Warning) << "heartbeat to " << coordinator_.address()
                      << " failed: " << known.status().message();
    } else if (!*known) {
      GT_LOG(Error) << "the coordinator no longer knows this worker (lease expired)";
    }
    for (int waited = 0; waited < interval_ms && !stop_; waited += 50) {
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
}

void Worker::WatchLoop() {
  while (!stop_) {
    auto context = std::make_unique<grpc::ClientContext>();
    grpc::ClientContext* raw = context.get();
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;  // Stop() may have run since the loop condition
      watch_context_ = std::move(context);
    }
    std::unique_ptr<grpc::ClientReader<v1::Plan>> reader = coordinator_.WatchPlan(raw);
    v1::Plan plan;
    bool done = false;
    while (reader->Read(&plan)) {
      absl::MutexLock lock(&mu_);
      GT_LOG(Info) << "plan epoch " << plan.epoch() << (plan.job_done() ? " (job done)" : "");
      done = plan.job_done();
      latest_plan_ = plan;
    }
    const grpc::Status status = reader->Finish();
    if (done) break;
    if (!stop_) {
      GT_LOG(Warning) << "plan watch ended (" << status.error_message() << "); reconnecting";
      absl::SleepFor(absl::Seconds(1));
    }
  }
  absl::MutexLock lock(&mu_);
  watch_ended_ = true;
}

}  // namespace geotrain
