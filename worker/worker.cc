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

// The share of the measured uplink the outer sync's transfers may use.
constexpr double kOuterUplinkShare = 0.2;
// Spot checks: what a worker keeps for audits, and each audit call's deadline.
constexpr uint64_t kAuditSentBytes = uint64_t{64} << 20;
// Weight versions with the optimizer state they were made with (AdamW: three
// times the weights), for output and update audits.
constexpr uint64_t kAuditWeightBytes = uint64_t{192} << 20;
constexpr absl::Duration kAuditRpcTimeout = absl::Seconds(30);

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
      coordinator_(options_.coordinator, options_.checkpoint_pacing),
      // A round's pseudo-gradient (a quarter of the stage's weights at
      // int8) or a new replica's outer state goes out over several steps
      // at this share, well within a round, and the pipeline's frames keep
      // the rest of the uplink. Unpaced until a measure finds the uplink.
      outer_pacer_(std::make_shared<UplinkSharePacer>(
          [this] { return coordinator_.pacer().uplink_bytes_per_s(); }, kOuterUplinkShare,
          &clock_)),
      commitments_(options_.commitment_log != nullptr ? *options_.commitment_log
                                                      : own_commitments_) {}

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
    training = session_ != nullptr;
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
  if (session_ != nullptr) session_->Abort();
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
  links_ = std::make_unique<WorkerLinks>(link_service_.get(), &link_options_);
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

void Worker::StartAuditResponder() {
  if (job_.verification().fraction() <= 0 || audit_responder_ != nullptr) return;
  // What an audit asks for comes a heartbeat or two after its step: these
  // bounds hold a few seconds of a small model's messages and versions.
  commitments_.SetMaxPayloadBytes(kAuditSentBytes);
  audit_weights_.SetMaxBytes(kAuditWeightBytes);
  AuditResponderOptions options;
  options.device = device_name_.empty() ? "cpu" : device_name_;
  options.log = &commitments_;
  options.weights = &audit_weights_;
  options.calls.worker_id = [this] { return coordinator_.worker_id(); };
  options.calls.upload = [this](const v1::AuditEvidence& evidence) {
    return coordinator_.UploadAuditEvidence(evidence, kAuditRpcTimeout);
  };
  options.calls.fetch = [this](uint64_t audit_id) {
    return coordinator_.FetchAudit(audit_id, kAuditRpcTimeout);
  };
  options.calls.report = [this](const v1::AuditVerdict& verdict) {
    return coordinator_.ReportAuditVerdict(verdict, kAuditRpcTimeout);
  };
  options.tamper_verdict = options_.tamper_verdict;
  audit_responder_ = std::make_unique<AuditResponder>(std::move(options));
  audit_responder_->SetJob(job_);
  coordinator_.OnAuditWork(
      [responder = audit_responder_.get()](const v1::HeartbeatResponse& response) {
        responder->Enqueue(response);
      });
  GT_LOG(Info) << "spot checks on (" << job_.verification().fraction()
               << " of computations): keeping up to " << (kAuditSentBytes >> 20)
               << " MiB of sent messages and " << (kAuditWeightBytes >> 20)
               << " MiB of weight versions";
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
  StartAuditResponder();
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
    const absl::Status trained = Train(*plan);
    if (trained.ok()) return absl::OkStatus();
    if (drain_) return HandOver();
    if (stop_) {
      coordinator_.Leave();
      return absl::CancelledError("stopped");
    }
    GT_LOG(Warning) << "stage " << mine->stage() << " of plan epoch " << plan->epoch()
                    << " ended: " << trained.message() << "; waiting for a new plan";
    // The plans it went on through are behind it: it waits for a newer one.
    last_epoch = std::max(last_epoch, served_plan_epoch_.load());

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
                                            const v1::StageAssignment& mine, uint64_t epoch,
                                            uint64_t rollback_epoch, int rollback_step) {
  if (runtime_ != nullptr && rollback_epoch > runtime_rollback_epoch_) {
    // A confirmed wrong computation: what this stage learnt since the
    // rollback's step came in part from it (docs/verification.md).
    GT_LOG(Warning) << "the job rolled back (plan epoch " << rollback_epoch
                    << "): discarding this stage's weights for the coordinator's checkpoints";
    coordinator_.ReportEvent("rollback_restore",
                             absl::StrCat("stage ", runtime_->placement().stage,
                                          ": its weights discarded, restoring the checkpoints of "
                                          "the rollback of epoch ", rollback_epoch));
    runtime_.reset();
  }
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
  if (options_.tamper_runtime) options_.tamper_runtime(&runtime_options);
  ASSIGN_OR_RETURN(std::unique_ptr<StageRuntime> runtime,
                   StageRuntime::Create(job_, placement, runtime_options));
  runtime_rollback_epoch_ = rollback_epoch;
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
  // In the plan that rolls back, every replica takes exactly the step it
  // rolled back to, though the stage's primary may have uploaded a newer
  // one since it restored.
  std::optional<int> exact_step;
  if (rollback_epoch > 0 && rollback_epoch == epoch) exact_step = rollback_step;
  for (int layer = placement.layer_begin; layer < placement.layer_end && from_peer.empty();
       ++layer) {
    absl::StatusOr<v1::LayerCheckpoint> checkpoint = coordinator_.LoadCheckpoint(
        layer, /*probe=*/false, MaxLayerStateBytes(job_, layer), exact_step);
    if (exact_step.value_or(0) > 0 && checkpoint.status().code() == absl::StatusCode::kNotFound) {
      // Not the seed's: the rollback's step should be kept; take the
      // newest rather than start the layer over.
      GT_LOG(Warning) << "no checkpoint of layer " << layer << " at the rollback's step "
                      << *exact_step << "; restoring the newest";
      checkpoint = coordinator_.LoadCheckpoint(layer, /*probe=*/false,
                                               MaxLayerStateBytes(job_, layer));
    }
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

absl::Status Worker::Train(const v1::Plan& plan) {
  ASSIGN_OR_RETURN(ServedPlan served, ServedPlan::For(plan, job_, worker_id_));
  // Workers on this host may have come or gone since the last plan: take
  // the fair share of the CPUs as it is now (this thread runs the compute).
  const ThreadShare threads = ApplyComputeThreads(options_.threads);
  if (threads.threads != stats_.Get().threads()) {
    GT_LOG(Info) << "compute threads: " << threads.threads << " (" << threads.reason << ")";
  }
  stats_.SetThreads(threads.threads, threads.reason);
  const int stage = served.stage();
  SessionOptions session_options;
  session_options.routes = options_.routes;
  session_options.dropped_microbatches = dropped_microbatches_;
  session_options.wrap_link = options_.wrap_link;
  session_options.on_serving = [this, stage](bool serving, const std::string& why) {
    health_.Set(serving, why);
    current_stage_ = serving ? stage : -1;
  };
  session_options.on_amended = [this](const ServedPlan& next) {
    served_plan_epoch_ = next.plan_epoch();
    OfferStateToNewcomers(next.assignment(), next.plan_epoch());
  };
  SessionParts parts;
  parts.coordinator = &coordinator_;
  parts.links = links_.get();
  parts.replicas = &averager_;
  parts.tied = &tied_;
  parts.stats = &stats_;
  parts.outer_pacer = outer_pacer_;
  parts.commitments = &commitments_;
  parts.audit_weights = &audit_weights_;
  auto session = std::make_shared<TrainingSession>(job_, served, parts, session_options);
  {
    absl::MutexLock lock(&mu_);
    if (stop_ || drain_ || rejoin_needed_ ||
        (latest_plan_.has_value() && latest_plan_->epoch() > plan.epoch())) {
      return absl::CancelledError("superseded before it started");
    }
    session_ = session;
  }
  // Whatever the exit path: no longer training this epoch.
  struct Unregister {
    Worker* worker;
    ~Unregister() {
      absl::MutexLock lock(&worker->mu_);
      worker->session_ = nullptr;
    }
  } unregister{this};
  ASSIGN_OR_RETURN(const bool built,
                   PrepareRuntime(served.placement(), served.schedule(), served.assignment(),
                                  plan.epoch(), plan.rollback_epoch(), plan.rollback_step()));
  OfferStateToNewcomers(served.assignment(), plan.epoch());
  primary_ = served.primary();
  served_plan_epoch_ = plan.epoch();
  const bool stale_weights = built || was_standby_;
  was_standby_ = false;
  return session->Run(runtime_.get(), stale_weights);
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
  // Reconnects are jittered, and back off while the coordinator answers
  // nothing: a thousand workers whose coordinator restarted do not all
  // return in the same instant.
  absl::Duration backoff = absl::Seconds(1);
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
      backoff = absl::Seconds(1);  // it answered
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
      // the job is done (stages finish on their own then) or this worker's
      // pipeline goes on in it as it was (TrainingSession::Amend).
      if (!done && session_ != nullptr && plan.epoch() > session_->plan_epoch()) {
        absl::StatusOr<ServedPlan> served = ServedPlan::For(plan, job_, worker_id_);
        if (served.ok() && session_->Amend(*served)) {
          GT_LOG(Info) << "plan epoch " << plan.epoch() << ": this worker's pipeline goes on";
          continue;
        }
        GT_LOG(Info) << "plan epoch " << plan.epoch() << " supersedes " << session_->plan().epoch()
                     << ": ending the current pipeline";
        AbortTrainingLocked();
      }
    }
    const grpc::Status status = reader->Finish();
    if (done) break;
    if (!stop_) {
      const absl::Duration wait = Jittered(backoff);
      GT_LOG(Warning) << "plan watch ended (" << status.error_message() << "); reconnecting in "
                      << absl::FormatDuration(absl::Trunc(wait, absl::Milliseconds(1)));
      for (absl::Duration waited; waited < wait && !stop_; waited += absl::Milliseconds(50)) {
        absl::SleepFor(absl::Milliseconds(50));
      }
      backoff = std::min(backoff * 2, absl::Seconds(10));
    }
  }
  absl::MutexLock lock(&mu_);
  watch_ended_ = true;
}

}  // namespace geotrain
