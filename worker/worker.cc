#include "worker/worker.h"

#include <malloc.h>

#include <unistd.h>

#include <algorithm>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/adaptive_codec.h"
#include "common/job_spec.h"
#include "common/layer_state.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/plan_util.h"
#include "common/process_stats.h"
#include "common/rpc_options.h"
#include "common/stage_metrics.h"
#include "common/status_macros.h"
#include "worker/device_probe.h"
#include "worker/layer_benchmark.h"
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
    : options_(std::move(options)),
      coordinator_(options_.coordinator, options_.checkpoint_pacing) {}

Worker::~Worker() {
  Stop();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  if (watch_thread_.joinable()) watch_thread_.join();
  health_.DetachAll();
  if (health_server_) health_server_->Shutdown(DeadlineFromNow(std::chrono::milliseconds(500)));
  if (server_) server_->Shutdown(DeadlineFromNow(std::chrono::milliseconds(1000)));
}

void Worker::Stop() {
  stop_ = true;
  health_.ShutDown("stopping");
  if (link_service_ != nullptr) link_service_->Shutdown();
  absl::MutexLock lock(&mu_);
  AbortTrainingLocked();
  if (watch_context_) watch_context_->TryCancel();
}

void Worker::Drain() {
  drain_ = true;
  bool training;
  {
    absl::MutexLock lock(&mu_);
    training = training_epoch_ != 0;
  }
  if (!training) {
    Stop();  // nothing to hand over
    return;
  }
  GT_LOG(Info) << "draining: handing the stage over before leaving";
  // First, so that the neighbours' reports of the links this closes are not
  // taken for a failure (which would give the stage away before it is saved).
  coordinator_.ReportEvent("draining", "handing the stage over");
  absl::MutexLock lock(&mu_);
  AbortTrainingLocked();
}

void Worker::AbortTrainingLocked() {
  abort_ = true;
  if (inbox_ != nullptr) inbox_->Close();
  for (const std::shared_ptr<LinkEnd>& link : open_links_) link->EndOnPurpose();
  if (link_service_ != nullptr) link_service_->Deactivate();
  averager_.Deactivate();
  tied_.Deactivate();  // ends an exchange that waits for a peer of the old plan
}

MetricsSnapshot Worker::Metrics() const {
  MetricsSnapshot out;
  const std::string name = options_.name.empty() ? worker_id_ : options_.name;
  const int stage = current_stage_;
  const MetricLabels labels = {{"worker", name}, {"stage", std::to_string(stage)}};
  out.Gauge("geotrain_worker_serving",
            "1 while the worker trains a stage with its links open (its gRPC health).",
            {{"worker", name}}, health_.serving() ? 1 : 0);
  if (stage >= 0) AppendStageMetrics(stats_.Get(), labels, &out);
  return out;
}

absl::Status Worker::StartServer() {
  EnableStandardServices();
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(&builder);
  int port = 0;
  link_options_.routes = options_.routes;
  link_options_.on_key_in_use_twice = [this](const std::string& worker,
                                             const std::string& detail) {
    coordinator_.ReportEvent("key_in_use_twice", detail, worker);
  };
  link_service_ = std::make_unique<LinkService>(link_options_);
  if (!worker_id_.empty()) link_service_->SetWorkerId(worker_id_);
  builder.AddListeningPort(
      options_.listen,
      MakeServerCredentials(link_options_.transport, ClientCertificates::kRequire), &port);
  builder.RegisterService(link_service_.get());
  builder.RegisterService(&averager_);
  builder.RegisterService(&tied_);
  builder.RegisterService(&state_server_);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen));
  }
  health_.Attach(server_.get());
  if (!options_.health_listen.empty()) {
    ASSIGN_OR_RETURN(health_server_, StartHealthServer(options_.health_listen));
    health_.Attach(health_server_.get());
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

absl::Status Worker::JoinCoordinator() {
  ASSIGN_OR_RETURN(v1::DeviceInfo device, ProbeDevice(options_.device, options_.threads));
  GT_LOG(Info) << "device " << device.device() << ", " << device.threads() << " thread(s) ("
               << device.threads_reason() << "), matmul " << device.matmul_gflops()
               << " GFLOP/s, BLAS " << device.blas();
  if (!device.environment().empty()) GT_LOG(Info) << "environment: " << device.environment();
  stats_.SetThreads(device.threads(), device.threads_reason());
  device_name_ = device.device();
  v1::JoinRequest join;
  join.set_name(options_.name);
  join.set_address(advertise_);
  *join.mutable_device() = device;
  ASSIGN_OR_RETURN(v1::JoinResponse joined,
                   coordinator_.JoinWithRetry(join, stop_, options_.join_timeout));
  if (!worker_id_.empty() && !options_.insecure && joined.worker_id() != worker_id_) {
    return absl::InternalError(absl::StrCat("joined as ", joined.worker_id(),
                                            " with the certificate of ", worker_id_));
  }
  worker_id_ = joined.worker_id();
  link_service_->SetWorkerId(worker_id_);
  if (joined.reachability().known() && !joined.reachability().reachable()) {
    GT_LOG(Warning) << "not reachable at " << advertise_ << ": " << joined.reachability().detail();
  } else if (joined.reachability().known()) {
    GT_LOG(Info) << "reachable: " << joined.reachability().detail();
  }
  job_ = joined.job();
  heartbeat_ms_ = joined.heartbeat_ms();
  GT_LOG(Info) << "joined " << coordinator_.address() << " as " << worker_id_
               << " for job " << job_.name();
  return absl::OkStatus();
}

void Worker::MeasureLayerKinds() {
  absl::StatusOr<std::map<std::string, double>> timings =
      TimeLayerKinds(job_, device_name_, kLayerTimingBudget);
  if (!timings.ok()) {
    GT_LOG(Warning) << "layer timings: " << timings.status().message()
                    << " (the planner uses GFLOP/s)";
    return;
  }
  std::string line;
  for (const auto& [kind, seconds] : *timings) {
    absl::StrAppendFormat(&line, " %s %.3f ms", kind, 1e3 * seconds);
  }
  GT_LOG(Info) << "layer timings per sample (forward + backward):" << line;
  // The timed layers were as large as the job's: give their memory back
  // rather than let the allocator keep it for the life of the worker.
  malloc_trim(0);
  coordinator_.SetLayerTimings(*std::move(timings));
}

absl::Status Worker::Run() {
  if (options_.insecure) {
    GT_LOG(Warning) << "--insecure: plaintext links, no identities (loopback demos and tests only)";
  } else {
    WorkerCredentialOptions credential_options;
    credential_options.coordinator = options_.coordinator;
    credential_options.token = options_.token;
    credential_options.state_dir = options_.state_dir;
    credential_options.name = options_.name;
    credential_options.coordinator_server_name = options_.tls_server_name;
    ASSIGN_OR_RETURN(WorkerCredentials credentials,
                     ObtainWorkerCredentials(credential_options, stop_, options_.join_timeout));
    worker_id_ = credentials.worker_id;
    coordinator_.UseSecurity(credentials.coordinator, options_.tls_server_name);
    link_options_.transport = credentials.peers;
    averager_.UseSecurity(credentials.peers);
    tied_.UseSecurity(credentials.peers);
    state_server_.UseSecurity(credentials.peers);
    peer_security_ = credentials.peers;
    prober_.UseSecurity(credentials.peers);
  }
  prober_.UseRoutes(options_.routes);
  coordinator_.UsePeerProber(&prober_);
  RETURN_IF_ERROR(StartServer());
  if (!options_.metrics_listen.empty()) {
    ASSIGN_OR_RETURN(metrics_,
                     MetricsExporter::Start(options_.metrics_listen, [this] { return Metrics(); }));
  }
  RETURN_IF_ERROR(JoinCoordinator());
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(heartbeat_ms_); });
  watch_thread_ = std::thread([this] { WatchLoop(); });
  // Pre-flight compute figures for the planner, on this (the compute)
  // thread before any stage is built: building a layer seeds LibTorch's
  // global generator, so no other thread may build one meanwhile. The
  // heartbeats already run, so the lease does not wait for it.
  MeasureLayerKinds();

  uint64_t last_epoch = 0;  // the newest plan this worker has acted on
  while (true) {
    std::optional<v1::Plan> plan = WaitForAssignment(last_epoch);
    bool rejoin = false;
    {
      absl::MutexLock lock(&mu_);
      rejoin = rejoin_needed_;
      rejoin_needed_ = false;
      if (latest_plan_.has_value()) last_epoch = std::max(last_epoch, latest_plan_->epoch());
    }
    if (stop_) {
      coordinator_.Leave();  // the coordinator re-plans at once, no lease to wait for
      return absl::CancelledError("stopped");
    }
    {
      absl::MutexLock lock(&fatal_mu_);
      if (!fatal_.ok()) {
        Stop();
        return fatal_;
      }
    }
    if (rejoin) {
      // Whatever this worker held is out of date: it joins as a standby
      // (insecure: under a new id; with TLS: as itself, by its certificate).
      runtime_.reset();
      GT_LOG(Warning) << "joining again";
      RETURN_IF_ERROR(JoinCoordinator());
      continue;
    }
    if (!plan.has_value()) {  // the job is over
      coordinator_.Leave();
      return absl::OkStatus();
    }
    last_epoch = plan->epoch();
    const v1::StageAssignment* mine = StageOf(*plan, worker_id_);
    if (mine == nullptr) {
      was_standby_ = true;  // a runtime kept meanwhile falls behind its stage
      continue;
    }
    const absl::Status trained = Train(*plan, *mine);
    if (trained.ok()) return absl::OkStatus();
    if (drain_) return HandOver();
    if (stop_) {
      coordinator_.Leave();
      return absl::CancelledError("stopped");
    }
    GT_LOG(Warning) << "stage " << mine->stage() << " of plan epoch " << plan->epoch()
                    << " ended: " << trained.message() << "; waiting for a new plan";

  }
}

absl::Status Worker::HandOver() {
  const int step = coordinator_.stage_step();
  if (runtime_ == nullptr) {
    coordinator_.Leave();
    return absl::CancelledError("drained (no stage)");
  }
  if (!primary_) {
    // The stage's other workers hold it; their weights are as good as ours.
    dropped_microbatches_ += runtime_->DropInFlight();
    coordinator_.ReportEvent("drain", "a replica leaves; its stage stays with the others");
    coordinator_.Leave();
    Stop();
    return absl::CancelledError("drained (replica)");
  }
  dropped_microbatches_ += runtime_->DropInFlight();
  // Nothing else runs on the stage now: stream it from its tensors.
  const absl::Status saved = coordinator_.UploadCheckpointNow(
      runtime_->StateBytes(),
      [this, step](const std::function<bool(const v1::LayerStateChunk&)>& emit) {
        return runtime_->StreamCheckpoint(step, emit);
      });
  if (saved.ok()) {
    coordinator_.ReportEvent("drain", absl::StrCat("layers [", runtime_->layer_begin(), ",",
                                                   runtime_->layer_end(), ") saved at step ",
                                                   step, "; leaving"));
  } else {
    GT_LOG(Error) << "drain: the stage could not be saved: " << saved.message();
    coordinator_.ReportEvent("drain", absl::StrCat("saving the stage failed: ", saved.message()));
  }
  coordinator_.Leave();
  Stop();
  GT_LOG(Info) << "drained at step " << step;
  return absl::CancelledError("drained");
}

std::optional<v1::Plan> Worker::WaitForAssignment(uint64_t after_epoch) {
  absl::MutexLock lock(&mu_);
  auto ready = [this, after_epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stop_ || watch_ended_ || rejoin_needed_) return true;
    if (!latest_plan_.has_value() || latest_plan_->epoch() <= after_epoch) return false;
    if (latest_plan_->job_done()) return true;
    return StageOf(*latest_plan_, worker_id_) != nullptr;
  };
  uint64_t announced = 0;
  while (!mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(1))) {
    if (latest_plan_.has_value() && latest_plan_->epoch() != announced) {
      GT_LOG(Info) << "standby: the plan of epoch " << latest_plan_->epoch()
                   << " has no stage for this worker";
      announced = latest_plan_->epoch();
    }
  }
  if (stop_ || rejoin_needed_ || !latest_plan_.has_value() || latest_plan_->job_done() ||
      latest_plan_->epoch() <= after_epoch) {
    return std::nullopt;
  }
  return latest_plan_;
}

void Worker::OfferStateToNewcomers(const v1::StageAssignment& mine, uint64_t epoch) {
  const v1::StateSource& source = mine.state_source();
  if (source.worker_id() != worker_id_ || source.for_workers().empty() || runtime_ == nullptr) {
    return;
  }
  // Taken now, before this epoch trains: the weights the newcomers start
  // from are the ones this worker starts from.
  absl::StatusOr<std::vector<v1::LayerCheckpoint>> layers =
      runtime_->ExportCheckpoint(coordinator_.stage_step());
  if (!layers.ok()) {
    GT_LOG(Warning) << "no state to offer the stage's newcomers: " << layers.status().message();
    return;
  }
  std::vector<std::string> newcomers(source.for_workers().begin(), source.for_workers().end());
  GT_LOG(Info) << "offering stage " << mine.stage() << "'s state (step "
               << coordinator_.stage_step() << ") to " << absl::StrJoin(newcomers, ", ");
  state_server_.Offer(epoch, mine.layer_begin(), mine.layer_end(), std::move(newcomers),
                      *std::move(layers));
}

absl::StatusOr<std::vector<v1::LayerCheckpoint>> Worker::FetchFromHolder(
    const v1::StageAssignment& mine, uint64_t epoch) {
  const v1::StateSource& source = mine.state_source();
  v1::FetchLayerStateRequest request;
  request.set_epoch(epoch);
  request.set_worker_id(worker_id_);
  request.set_layer_begin(mine.layer_begin());
  request.set_layer_end(mine.layer_end());
  uint64_t largest = 0, total = 0;
  for (int layer = mine.layer_begin(); layer < mine.layer_end(); ++layer) {
    largest = std::max(largest, MaxLayerStateBytes(job_, layer));
    total += MaxLayerStateBytes(job_, layer);
  }
  auto route = options_.routes.find(source.address());
  const std::string address = route != options_.routes.end() ? route->second : source.address();
  // As for the coordinator: 30 s, plus 1 s per MiB.
  return FetchStageState(address, source.worker_id(), peer_security_, request, largest,
                         absl::Seconds(30 + static_cast<int64_t>(total >> 20)));
}

absl::StatusOr<bool> Worker::PrepareRuntime(const StagePlacement& placement,
                                            const ScheduleConfig& schedule,
                                            const v1::StageAssignment& mine, uint64_t epoch) {
  if (runtime_ != nullptr) {
    const StagePlacement& held = runtime_->placement();
    const bool same_place =
        held.stage == placement.stage && held.num_stages == placement.num_stages &&
        held.layer_begin == placement.layer_begin && held.layer_end == placement.layer_end;
    // A worker that gets back a stage it held before (it was a standby
    // meanwhile) keeps its own weights only if nobody trained the stage
    // since: a newer checkpoint of it means another worker did. One that
    // held it all along keeps them (a replica's step may trail the
    // primary's newest checkpoint without its weights being stale).
    if (same_place && was_standby_) {
      absl::StatusOr<v1::LayerCheckpoint> newest =
          coordinator_.LoadCheckpoint(placement.layer_begin, /*probe=*/true);
      if (newest.ok() && newest->step() > coordinator_.stage_step()) {
        GT_LOG(Info) << "the stage's checkpoint (step " << newest->step()
                     << ") is newer than this worker's weights (step "
                     << coordinator_.stage_step() << "): restoring it";
        runtime_.reset();
      }
    }
    if (runtime_ != nullptr && same_place) {
      const int dropped = runtime_->DropInFlight();
      dropped_microbatches_ += dropped;
      if (dropped > 0) {
        coordinator_.ReportEvent("dropped", absl::StrCat(dropped, " microbatches in flight on "
                                                         "the old route; their weights freed"));
      }
      return false;
    }
    runtime_.reset();
  }
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
  // A live worker that keeps this stage gives us its state, if the plan
  // names one; otherwise (or if it cannot) every layer that has a
  // checkpoint starts from it, the rest from the seed (a layer nobody has
  // checkpointed yet).
  std::vector<v1::LayerCheckpoint> found;
  std::vector<int> missing;
  const v1::StateSource& source = mine.state_source();
  std::string from_peer;
  if (!source.worker_id().empty() && source.worker_id() != worker_id_ &&
      std::find(source.for_workers().begin(), source.for_workers().end(), worker_id_) !=
          source.for_workers().end()) {
    absl::StatusOr<std::vector<v1::LayerCheckpoint>> fetched = FetchFromHolder(mine, epoch);
    if (fetched.ok()) {
      found = *std::move(fetched);
      from_peer = source.worker_id();
    } else {
      GT_LOG(Warning) << "the stage's state from " << source.worker_id() << " failed ("
                      << fetched.status().message() << "); taking the coordinator's checkpoints";
      coordinator_.ReportEvent("state_fetch_failed", std::string(fetched.status().message()),
                               source.worker_id());
    }
  }
  for (int layer = placement.layer_begin; layer < placement.layer_end && from_peer.empty();
       ++layer) {
    absl::StatusOr<v1::LayerCheckpoint> checkpoint = coordinator_.LoadCheckpoint(layer, /*probe=*/false, MaxLayerStateBytes(job_, layer));
    if (checkpoint.ok()) {
      found.push_back(*std::move(checkpoint));
    } else if (checkpoint.status().code() == absl::StatusCode::kNotFound) {
      missing.push_back(layer);
    } else {
      return checkpoint.status();
    }
  }
  if (!found.empty()) RETURN_IF_ERROR(runtime->RestoreCheckpoint(found));
  std::string detail = absl::StrCat("stage ", placement.stage, ", layers [", placement.layer_begin,
                                    ",", placement.layer_end, "): ");
  if (!found.empty()) absl::StrAppend(&detail, found.size(), " restored from step ", found[0].step());
  if (!from_peer.empty()) {
    absl::StrAppend(&detail, " from peer ", from_peer, " (live state, not the coordinator's)");
  }
  if (!missing.empty()) {
    absl::StrAppend(&detail, found.empty() ? "" : "; ", missing.size(),
                    " without a checkpoint start from the seed");
  }
  GT_LOG(Info) << detail;
  coordinator_.ReportEvent("restored", detail);
  runtime_ = std::move(runtime);
  return true;
}

absl::Status Worker::Train(const v1::Plan& plan, const v1::StageAssignment& mine) {
  const int num_stages = plan.stages_size();
  GT_LOG(Info) << "stage " << mine.stage() << "/" << num_stages << ": layers ["
               << mine.layer_begin() << "," << mine.layer_end() << "), epoch "
               << plan.epoch() << ", from step " << plan.start_step();
  StagePlacement placement{mine.stage(), num_stages, mine.layer_begin(), mine.layer_end()};
  // Workers on this host may have come or gone since the last plan: take
  // the fair share of the CPUs as it is now (this thread runs the compute).
  const ThreadShare threads = ApplyComputeThreads(options_.threads);
  if (threads.threads != stats_.Get().threads()) {
    GT_LOG(Info) << "compute threads: " << threads.threads << " (" << threads.reason << ")";
  }
  stats_.SetThreads(threads.threads, threads.reason);
  // The default window is one microbatch in flight per worker, replicas
  // included (each stage derives the same figure from the same plan).
  const ScheduleConfig schedule = ConfigureSchedule(job_, WorkersInPlan(plan), plan.in_flight());
  auto inbox = std::make_shared<Inbox>(64);
  {
    absl::MutexLock lock(&mu_);
    if (stop_ || drain_ || rejoin_needed_ ||
        (latest_plan_.has_value() && latest_plan_->epoch() > plan.epoch())) {
      return absl::CancelledError("superseded before it started");
    }
    abort_ = false;
    training_epoch_ = plan.epoch();
    inbox_ = inbox;
  }
  // Whatever the exit path: no longer training this epoch.
  struct Unregister {
    Worker* worker;
    ~Unregister() {
      absl::MutexLock lock(&worker->mu_);
      if (worker->inbox_ != nullptr) worker->inbox_->Close();
      worker->inbox_ = nullptr;
      worker->open_links_.clear();
      worker->training_epoch_ = 0;
      worker->averager_.Deactivate();
      worker->tied_.Deactivate();
    }
  } unregister{this};
  ASSIGN_OR_RETURN(const bool built, PrepareRuntime(placement, schedule, mine, plan.epoch()));
  OfferStateToNewcomers(mine, plan.epoch());
  StageRuntime* runtime = runtime_.get();
  // The plan's codec for each of this stage's links (the network planner
  // compresses only the links that bind), each direction on its own ladder
  // and never past the job's codec; a runtime kept from an earlier plan
  // takes the new ones too.
  const v1::Codec activation_codec =
      mine.stage() + 1 < num_stages ? CapToLadder(mine.link_codec(), job_.activation_codec())
                                    : job_.activation_codec();
  const v1::Codec gradient_codec =
      mine.stage() > 0
          ? CapToLadder(plan.stages(mine.stage() - 1).link_codec(), job_.gradient_codec())
          : job_.gradient_codec();
  runtime->SetActivationCodec(activation_codec);
  runtime->SetGradientCodec(gradient_codec);
  const std::vector<StageWorker> upstream_workers =
      mine.stage() > 0 ? WorkersOf(plan.stages(mine.stage() - 1)) : std::vector<StageWorker>();
  const std::vector<StageWorker> downstream_workers =
      mine.stage() + 1 < num_stages ? WorkersOf(plan.stages(mine.stage() + 1))
                                    : std::vector<StageWorker>();
  const std::vector<StageWorker> stage_workers = WorkersOf(mine);
  std::set<std::string> upstream_ids;
  for (const StageWorker& w : upstream_workers) upstream_ids.insert(w.id);
  auto validator = std::make_shared<const LinkValidator>(job_, plan.epoch(), mine.stage(),
                                                         mine.layer_begin(), mine.layer_end(),
                                                         std::move(upstream_ids));
  coordinator_.SetEpoch(plan.epoch());
  // Who opens each of this worker's links (a plan without links, from an
  // older coordinator, has every upstream worker dial).
  auto planned_link = [&plan](const std::string& up, const std::string& down) {
    for (const v1::PlannedLink& link : plan.links()) {
      if (link.upstream_worker() == up && link.downstream_worker() == down) return &link;
    }
    return static_cast<const v1::PlannedLink*>(nullptr);
  };
  auto dialer_of = [](const v1::PlannedLink* link) {
    return link == nullptr || link->dialer() == v1::LINK_DIALER_UNSPECIFIED
               ? v1::LINK_DIALER_UPSTREAM
               : link->dialer();
  };
  std::set<std::string> dialling_downstream;
  for (const StageWorker& next : downstream_workers) {
    if (dialer_of(planned_link(worker_id_, next.id)) == v1::LINK_DIALER_DOWNSTREAM) {
      dialling_downstream.insert(next.id);
    }
  }
  link_service_->Activate(validator, inbox, dialling_downstream);
  primary_ = stage_workers[0].id == worker_id_;
  if (stage_workers.size() > 1) {
    ReplicaAverager::Target target;
    target.epoch = plan.epoch();
    target.stage = mine.stage();
    target.layer_begin = mine.layer_begin();
    target.layer_end = mine.layer_end();
    target.self_id = worker_id_;
    target.max_layer_bytes = 0;
    for (int layer = mine.layer_begin(); layer < mine.layer_end(); ++layer) {
      target.max_layer_bytes = std::max(target.max_layer_bytes, MaxLayerWeightsBytes(job_, layer));
    }
    for (const StageWorker& w : stage_workers) {
      if (w.id == worker_id_) continue;
      auto route = options_.routes.find(w.address);
      target.peers.push_back({w.id, route == options_.routes.end() ? w.address : route->second});
    }
    GT_LOG(Info) << "stage " << mine.stage() << " has " << stage_workers.size()
                 << " workers; this one is " << (primary_ ? "the primary" : "a replica");
    averager_.Activate(std::move(target));
  }

  // Tied embeddings: the first stage's worker and the last's trade the
  // tied matrix's gradient at each update (sync only; no replicas).
  if (runtime->holds_one_tied_end()) {
    const int other = mine.stage() == 0 ? num_stages - 1 : 0;
    const std::vector<StageWorker> ends = WorkersOf(plan.stages(other));
    if (ends.size() != 1 || stage_workers.size() != 1) {
      return absl::FailedPreconditionError(
          "tied embeddings need one worker on the first stage and one on the last");
    }
    TiedGradientExchange::Target target;
    target.epoch = plan.epoch();
    target.stage = mine.stage();
    target.self_id = worker_id_;
    target.peer_stage = other;
    target.peer_id = ends[0].id;
    auto route = options_.routes.find(ends[0].address);
    target.peer_address = route == options_.routes.end() ? ends[0].address : route->second;
    target.gradient_bytes = StageRuntime::TiedEmbeddingBytes(job_);
    tied_.Activate(std::move(target));
  }

  // The links are unregistered (under mu_) before they are destroyed.
  std::vector<std::shared_ptr<LinkEnd>> links;
  // Whatever the exit path, every link of this attempt ends with it (a
  // reader thread keeps its end alive until the link ends).
  struct UnregisterLinks {
    Worker* worker;
    ~UnregisterLinks() {
      absl::MutexLock lock(&worker->mu_);
      for (const std::shared_ptr<LinkEnd>& link : worker->open_links_) link->EndOnPurpose();
      worker->open_links_.clear();
    }
  } unregister_links{this};
  // Opens (or awaits) the link to `peer`; null when the peer dials this
  // worker's Stage service (its link joins UpstreamLinks there). A link
  // that cannot be opened is reported like a broken one (naming its relay
  // when it had one), or nothing would ever re-plan around it.
  auto open = [&](const StageWorker& peer,
                  PeerSide side) -> absl::StatusOr<std::shared_ptr<LinkEnd>> {
    const bool to_downstream = side == PeerSide::kDownstream;
    const v1::PlannedLink* planned = to_downstream ? planned_link(worker_id_, peer.id)
                                                   : planned_link(peer.id, worker_id_);
    const v1::LinkDialer dialer = dialer_of(planned);
    absl::StatusOr<std::shared_ptr<LinkEnd>> end;
    std::string accused = peer.id;
    if (dialer == v1::LINK_DIALER_NONE) {
      end = absl::FailedPreconditionError(
          absl::StrCat("no way to open the ", PeerSideName(side), " link to '", peer.id,
                       "': ", planned->reason()));
    } else if (dialer == v1::LINK_DIALER_UPSTREAM && !to_downstream) {
      return std::shared_ptr<LinkEnd>();  // it dials in
    } else if (dialer == v1::LINK_DIALER_DOWNSTREAM && to_downstream) {
      GT_LOG(Info) << "waiting for '" << peer.id << "' to dial in (" << planned->reason() << ")";
      end = link_service_->AwaitDownstream(peer.id, link_options_.connect_timeout, &abort_);
    } else {
      if (dialer == v1::LINK_DIALER_RELAY) accused = planned->relay_worker();
      DialTarget target{worker_id_, mine.stage(), {peer.id, peer.address, side}, planned};
      end = OpenLink(target, validator, inbox, link_options_, link_service_.get(), &abort_);
    }
    if (!end.ok()) {
      if (!abort_ && dialer != v1::LINK_DIALER_NONE) {
        coordinator_.ReportEvent("link_lost",
                                 absl::StrCat(PeerSideName(side), " link to ", peer.address,
                                              " could not be opened: ", end.status().message()),
                                 accused);
      }
      GT_LOG(Error) << end.status().message();
      return end.status();
    }
    absl::MutexLock lock(&mu_);
    open_links_.push_back(*end);
    if (abort_) (*end)->EndOnPurpose();
    links.push_back(*end);
    return end;
  };
  // Downstream links first: the chain of waits (an end waiting for its
  // neighbour to dial in, or at a relay) then runs toward the last stage,
  // which waits for no one.
  std::vector<ReplicaRouter::Route> routes;
  for (const StageWorker& next : downstream_workers) {
    ASSIGN_OR_RETURN(std::shared_ptr<LinkEnd> end, open(next, PeerSide::kDownstream));
    routes.push_back({next.id, next.address, end.get()});
  }
  for (const StageWorker& previous : upstream_workers) {
    RETURN_IF_ERROR(open(previous, PeerSide::kUpstream).status());
  }
  std::optional<ReplicaRouter> router;
  if (!routes.empty()) router.emplace(std::move(routes));
  PipelineDriverOptions driver_options;
  driver_options.epoch = plan.epoch();
  driver_options.stage = mine.stage();
  driver_options.num_stages = num_stages;
  driver_options.start_step = plan.start_step();
  driver_options.schedule = schedule;
  driver_options.dropped_microbatches = dropped_microbatches_;
  driver_options.upstream_workers = std::max<int>(1, upstream_workers.size());
  // Two leases, as long as the coordinator gives a silent worker.
  driver_options.reply_timeout =
      ReplyTimeoutFor(absl::Milliseconds(2 * job_.lease_ms()), mine.stage(), num_stages);
  driver_options.replicated = stage_workers.size() > 1;
  driver_options.primary = primary_;
  if (mine.stage() == 0) {
    // The plan lists stage 0's workers in the same order for every one of
    // them, which fixes each replica's share of the microbatch ids.
    driver_options.stage_replicas = static_cast<int>(stage_workers.size());
    for (size_t i = 0; i < stage_workers.size(); ++i) {
      if (stage_workers[i].id == worker_id_) driver_options.replica_index = static_cast<int>(i);
    }
  }
  driver_options.averager = stage_workers.size() > 1 ? &averager_ : nullptr;
  driver_options.tied = runtime->holds_one_tied_end() ? &tied_ : nullptr;
  // Joining a stage that is already training: this worker's weights come
  // from a checkpoint, or were kept while it was a standby; its siblings'
  // are newer.
  driver_options.catching_up =
      (built || was_standby_) && stage_workers.size() > 1 && plan.start_step() > 0;
  was_standby_ = false;
  driver_options.router = router ? &*router : nullptr;
  // Only where the plan chose (the driver says "fixed by the job" otherwise).
  if (mine.link_codec() != v1::CODEC_UNSPECIFIED) driver_options.activation_codec = activation_codec;
  if (mine.stage() > 0 && plan.stages(mine.stage() - 1).link_codec() != v1::CODEC_UNSPECIFIED) {
    driver_options.gradient_codec = gradient_codec;
  }
  auto addresses = [](const std::vector<StageWorker>& workers) {
    std::string joined;
    for (const StageWorker& w : workers) absl::StrAppend(&joined, joined.empty() ? "" : ",", w.address);
    return joined;
  };
  driver_options.upstream_peer = addresses(upstream_workers);
  driver_options.downstream_peer = addresses(downstream_workers);
  if (downstream_workers.size() == 1) driver_options.downstream_worker = downstream_workers[0].id;
  GT_LOG(Info) << "schedule " << ScheduleName(job_.schedule()) << ": window " << schedule.window
               << ", update every " << schedule.update_every << " backward(s)"
               << (schedule.flush ? ", flush each step" : ", no flush");
  MessageSink* up_sink = mine.stage() > 0 ? link_service_->upstream_links() : nullptr;
  MessageSink* down_sink = router ? &*router : nullptr;
  std::unique_ptr<MessageSink> up_wrapper, down_wrapper;
  if (options_.wrap_link) {
    if (up_sink != nullptr) {
      up_wrapper = options_.wrap_link(PeerSide::kUpstream, up_sink);
      up_sink = up_wrapper.get();
    }
    if (down_sink != nullptr) {
      down_wrapper = options_.wrap_link(PeerSide::kDownstream, down_sink);
      down_sink = down_wrapper.get();
    }
  }
  PipelineDriver driver(job_, driver_options, runtime, up_sink, down_sink, inbox.get(),
                        &coordinator_, &stats_);
  health_.Set(true, absl::StrCat("stage ", mine.stage(), " of plan epoch ", plan.epoch(),
                                 ": links open, training"));
  current_stage_ = mine.stage();
  absl::Status ran = driver.Run();
  current_stage_ = -1;
  health_.Set(false, ran.ok() ? std::string("the job is finished")
                              : absl::StrCat("stage ", mine.stage(), " of plan epoch ",
                                             plan.epoch(), " ended: ", ran.message()));
  if (!ran.ok()) {
    // A broken link (not one this worker ended itself) is reported with the
    // neighbour at its other end, so the coordinator can route around it
    // without waiting for a lease: a blackholed link never ends a lease.
    // The report goes before this worker ends its other links: ending them
    // breaks its healthy neighbours' links too, and their reports (naming
    // this worker) must not reach the coordinator first, or it would take
    // out this worker instead of the peer that failed. The coordinator acts
    // on an epoch's first report only.
    const PipelineDriver::FailedLink failed = driver.failed_link();
    if (failed != PipelineDriver::FailedLink::kNone && !abort_) {
      const bool up = failed == PipelineDriver::FailedLink::kUpstream;
      const std::vector<StageWorker>& neighbours = up ? upstream_workers : downstream_workers;
      StageWorker peer = neighbours.empty() ? StageWorker() : neighbours[0];
      for (const StageWorker& w : neighbours) {
        if (w.id == driver.failed_peer()) peer = w;
      }
      // Through a relay, the relay is what is reported: the coordinator
      // re-links the pair through another (see JobController).
      const v1::PlannedLink* planned =
          up ? planned_link(peer.id, worker_id_) : planned_link(worker_id_, peer.id);
      const bool relayed = planned != nullptr && planned->dialer() == v1::LINK_DIALER_RELAY;
      coordinator_.ReportEvent("link_lost",
                               absl::StrCat(up ? "upstream" : "downstream", " link to ",
                                            peer.address,
                                            relayed ? " via relay " + planned->relay_address() : "",
                                            ": ", ran.message()),
                               relayed ? planned->relay_worker() : peer.id);
    }
    link_service_->Deactivate();
    for (const std::shared_ptr<LinkEnd>& link : links) link->EndOnPurpose();
    return ran;
  }
  // Downstream links first (see above), then the upstream ones this worker
  // opened; a link a peer opened here ends when that peer closes it.
  for (PeerSide side : {PeerSide::kDownstream, PeerSide::kUpstream}) {
    for (const std::shared_ptr<LinkEnd>& link : links) {
      if (link->peer().side != side) continue;
      absl::Status closed = link->Close(link_options_.close_timeout);
      if (!closed.ok()) GT_LOG(Warning) << "closing a link: " << closed.message();
    }
  }
  GT_LOG(Info) << "stage " << mine.stage() << " finished " << job_.steps() << " steps";
  // A last heartbeat so that the status shows the final step and memory.
  (void)coordinator_.Heartbeat(ResidentBytes(), stats_.Get());
  // The coordinator may be restarting: keep trying for a while.
  absl::Status done = coordinator_.ReportDone(job_.steps());
  for (int attempt = 0; !done.ok() && attempt < 30 && !stop_; ++attempt) {
    absl::SleepFor(absl::Seconds(1));
    done = coordinator_.ReportDone(job_.steps());
  }
  return done;
}

void Worker::HeartbeatLoop(int interval_ms) {
  while (!stop_) {
    absl::StatusOr<bool> known = coordinator_.Heartbeat(ResidentBytes(), stats_.Get());
    if (!known.ok() && (known.status().code() == absl::StatusCode::kPermissionDenied ||
                        known.status().code() == absl::StatusCode::kUnauthenticated)) {
      GT_LOG(Error) << "the coordinator refuses this worker: " << known.status().message();
      {
        absl::MutexLock lock(&fatal_mu_);
        fatal_ = known.status();
      }
      absl::MutexLock lock(&mu_);
      rejoin_needed_ = true;  // wakes Run(), which stops
      AbortTrainingLocked();
      return;
    }
    if (!known.ok()) {
      GT_LOG(Warning) << "heartbeat to " << coordinator_.address()
                      << " failed: " << known.status().message();
    } else if (!*known) {
      GT_LOG(Error) << "the coordinator no longer knows this worker (lease expired)";
      absl::MutexLock lock(&mu_);
      if (!rejoin_needed_) {
        rejoin_needed_ = true;
        AbortTrainingLocked();
      }
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
      if (latest_plan_.has_value() && plan.epoch() <= latest_plan_->epoch()) continue;
      GT_LOG(Info) << "plan epoch " << plan.epoch() << (plan.job_done() ? " (job done)" : "");
      done = plan.job_done();
      if (link_service_ != nullptr) {
        link_service_->SetRevoked(
            std::set<std::string>(plan.revoked_workers().begin(), plan.revoked_workers().end()));
      }
      latest_plan_ = plan;
      // Every stage of a new plan starts over on the new epoch, except when
      // the job is done (stages finish on their own then).
      if (!done && training_epoch_ != 0 && plan.epoch() > training_epoch_) {
        GT_LOG(Info) << "plan epoch " << plan.epoch() << " supersedes " << training_epoch_
                     << ": ending the current pipeline";
        AbortTrainingLocked();
      }
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
