#include "worker/coordinator_client.h"

#include <malloc.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "common/join_token.h"
#include "common/layer_state.h"
#include "common/logging.h"
#include "common/process_stats.h"
#include "common/status_macros.h"
#include "common/rpc_options.h"

namespace geotrain {

CoordinatorClient::CoordinatorClient(std::string address, CheckpointPacingOptions pacing)
    : address_(std::move(address)),
      stub_(v1::Coordinator::NewStub(MakeChannel(address_))),
      pacer_(pacing, &clock_) {
  std::shared_ptr<grpc::Channel> bulk = MakeChannel(address_, Connection::kOwn);
  bulk_stub_ = v1::Coordinator::NewStub(bulk);
  audit_stub_ = v1::Audit::NewStub(bulk);
}

void CoordinatorClient::UseSecurity(const TransportSecurity& security,
                                    const std::string& server_name) {
  stub_ = v1::Coordinator::NewStub(MakeSecureChannel(address_, security, server_name));
  std::shared_ptr<grpc::Channel> bulk =
      MakeSecureChannel(address_, security, server_name, Connection::kOwn);
  bulk_stub_ = v1::Coordinator::NewStub(bulk);
  audit_stub_ = v1::Audit::NewStub(bulk);
}

absl::Status CoordinatorClient::UploadAuditEvidence(const v1::AuditEvidence& evidence,
                                                    absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout))));
  v1::ReportAck ack;
  return FromGrpcStatus(audit_stub_->UploadEvidence(&context, evidence, &ack));
}

absl::StatusOr<v1::AuditBundle> CoordinatorClient::FetchAudit(uint64_t audit_id,
                                                              absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout))));
  v1::FetchAuditRequest request;
  request.set_worker_id(worker_id());
  request.set_audit_id(audit_id);
  v1::AuditBundle bundle;
  const grpc::Status status = audit_stub_->FetchAudit(&context, request, &bundle);
  if (!status.ok()) return FromGrpcStatus(status);
  return bundle;
}

absl::Status CoordinatorClient::ReportAuditVerdict(const v1::AuditVerdict& verdict,
                                                   absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout))));
  v1::ReportAck ack;
  return FromGrpcStatus(audit_stub_->ReportVerdict(&context, verdict, &ack));
}

absl::StatusOr<v1::JoinResponse> CoordinatorClient::JoinWithRetry(
    const v1::JoinRequest& request, const std::atomic<bool>& stop,
    absl::Duration give_up_after) {
  const absl::Time give_up = absl::Now() + give_up_after;
  absl::Duration backoff = absl::Milliseconds(500);
  // One session for every attempt of this join: an attempt whose answer
  // came too late leaves the coordinator a member that the next attempt
  // is given, not a second one (Membership::Join).
  v1::JoinRequest attempt = request;
  if (attempt.session_id().empty()) attempt.set_session_id(RandomHexSecret(16));
  while (!stop) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(kControlRpcTimeout));
    v1::JoinResponse response;
    const grpc::Status status = stub_->Join(&context, attempt, &response);
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      worker_id_ = response.worker_id();
      return response;
    }
    const bool retryable = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!retryable) {
      return absl::Status(FromGrpcStatus(status).code(),
                          absl::StrFormat("coordinator at %s refused the join: %s",
                                          address_, status.error_message()));
    }
    if (absl::Now() + backoff > give_up) {
      return absl::UnavailableError(absl::StrFormat(
          "cannot reach coordinator at %s: %s", address_, status.error_message()));
    }
    const absl::Duration wait = Jittered(backoff);
    GT_LOG(Warning) << "cannot reach coordinator at " << address_ << " ("
                    << status.error_message() << "); retrying in "
                    << absl::FormatDuration(absl::Trunc(wait, absl::Milliseconds(1)));
    absl::SleepFor(wait);
    backoff = std::min(backoff * 2, absl::Seconds(10));
  }
  return absl::CancelledError("stopped before joining");
}

void CoordinatorClient::SetEpoch(uint64_t epoch) { epoch_ = epoch; }

std::string CoordinatorClient::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

CoordinatorClient::~CoordinatorClient() {
  {
    absl::MutexLock lock(&mu_);
    uploader_stop_ = true;
  }
  if (uploader_.joinable()) uploader_.join();
}

namespace {

// A transfer's deadline grows with its size: 30 s, plus 1 s per MiB (a
// slow uplink), so a large layer is not cut off for being large.
std::chrono::seconds StateDeadline(uint64_t payload_bytes) {
  return std::chrono::seconds(30 + static_cast<int64_t>(payload_bytes >> 20));
}

// A paced upload's deadline: 30 s plus twice its time at the pace.
std::chrono::seconds PacedDeadline(uint64_t payload_bytes, double bytes_per_s) {
  if (bytes_per_s <= 0) return StateDeadline(payload_bytes);
  const double paced_s = static_cast<double>(payload_bytes) / bytes_per_s;
  return std::max(StateDeadline(payload_bytes),
                  std::chrono::seconds(30 + static_cast<int64_t>(2 * paced_s)));
}

}  // namespace

bool CoordinatorClient::AwaitPace(uint64_t bytes) {
  const absl::Duration wait = pacer_.Reserve(bytes);
  absl::MutexLock lock(&mu_);
  if (wait > absl::ZeroDuration()) {
    mu_.AwaitWithTimeout(absl::Condition(&uploader_stop_), wait);
  }
  return !uploader_stop_;
}

absl::Status CoordinatorClient::SaveCheckpoint(std::vector<v1::LayerCheckpoint> layers) {
  absl::Status status;
  {
    uint64_t total = 0;
    for (const v1::LayerCheckpoint& layer : layers) total += layer.payload().size();
    const double pace = pacer_.bytes_per_s();
    const absl::Time started = absl::Now();
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(PacedDeadline(total, pace)));
    v1::SaveCheckpointResponse response;
    auto writer = bulk_stub_->SaveCheckpoint(&context, &response);
    const std::string id = worker_id();
    bool stopped = false;
    for (v1::LayerCheckpoint& layer : layers) {
      layer.set_worker_id(id);
      const bool sent = ForEachLayerStateChunk(
          layer, pacer_.PartBytes(), [&](const v1::LayerStateChunk& chunk) {
            if (!AwaitPace(chunk.ByteSizeLong())) {
              stopped = true;
              return false;
            }
            return writer->Write(chunk);
          });
      if (!sent) break;
      // Sent: its megabytes are not needed any more.
      std::string().swap(*layer.mutable_payload());
    }
    if (stopped) context.TryCancel();
    writer->WritesDone();
    const grpc::Status finished = writer->Finish();
    status = stopped ? absl::CancelledError("the worker is stopping") : FromGrpcStatus(finished);
    if (status.ok() && !layers.empty()) {
      GT_LOG(Info) << "checkpoint of step " << layers[0].step() << " uploaded: "
                   << absl::StrFormat("%.1f MB in %.1f s", total / 1e6,
                                      absl::ToDoubleSeconds(absl::Now() - started))
                   << (pace > 0 ? absl::StrFormat(", paced at %.1f Mb/s", pace * 8 / 1e6)
                                : std::string(", not paced"));
    }
  }
  layers.clear();
  // A checkpoint is megabytes of short-lived buffers, freed on this thread;
  // hand them back to the system rather than let the allocator keep them.
  malloc_trim(0);
  return status;
}

absl::Status CoordinatorClient::UploadCheckpointNow(uint64_t bytes,
                                                    const LayerStateWriter& write) {
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(StateDeadline(bytes)));
  v1::SaveCheckpointResponse response;
  auto writer = bulk_stub_->SaveCheckpoint(&context, &response);
  const std::string id = worker_id();
  const absl::Status written = write([&](const v1::LayerStateChunk& chunk) {
    if (!chunk.has_header()) return writer->Write(chunk);
    v1::LayerStateChunk first = chunk;  // the header chunk: small
    first.mutable_header()->set_worker_id(id);
    return writer->Write(first);
  });
  writer->WritesDone();
  const absl::Status finished = FromGrpcStatus(writer->Finish());
  return finished.ok() ? written : finished;
}

absl::StatusOr<std::vector<v1::LayerCheckpoint>> ReceiveLayerStates(
    grpc::ClientReader<v1::LayerStateChunk>& reader, uint64_t max_layer_bytes) {
  LayerStateCollector collector;
  LayerStateReceiver receiver(&collector, max_layer_bytes);
  v1::LayerStateChunk chunk;
  absl::Status received;
  while (reader.Read(&chunk)) {
    received = receiver.Add(chunk);
    if (!received.ok()) break;
  }
  const absl::Status finished = FromGrpcStatus(reader.Finish());
  if (!finished.ok()) return finished;
  if (received.ok()) received = receiver.Finish();
  if (!received.ok()) return received;
  return std::move(collector.layers());
}

absl::StatusOr<v1::LayerCheckpoint> CoordinatorClient::LoadCheckpoint(int layer, bool probe,
                                                                       uint64_t max_layer_bytes,
                                                                       std::optional<int> step) {
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(StateDeadline(probe ? 0 : max_layer_bytes)));
  v1::LoadCheckpointRequest request;
  request.set_worker_id(worker_id());
  request.set_layer(layer);
  request.set_probe(probe);
  if (step.has_value()) request.set_step(*step);
  std::unique_ptr<grpc::ClientReader<v1::LayerStateChunk>> reader =
      bulk_stub_->LoadCheckpoint(&context, request);
  ASSIGN_OR_RETURN(std::vector<v1::LayerCheckpoint> layers,
                   ReceiveLayerStates(*reader, max_layer_bytes));
  if (layers.size() != 1 || layers[0].layer() != layer) {
    return absl::InvalidArgumentError(absl::StrCat("the restore of layer ", layer, " brought ",
                                                   layers.size(), " layers"));
  }
  return std::move(layers[0]);
}

void CoordinatorClient::CheckpointReady(std::vector<v1::LayerCheckpoint> layers) {
  absl::MutexLock lock(&mu_);
  pending_upload_ = std::move(layers);  // a newer checkpoint replaces one not yet sent
  if (!uploader_.joinable()) uploader_ = std::thread([this] { UploadLoop(); });
}

void CoordinatorClient::UploadLoop() {
  while (true) {
    std::vector<v1::LayerCheckpoint> layers;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return uploader_stop_ || pending_upload_.has_value();
      };
      mu_.Await(absl::Condition(&ready));
      if (uploader_stop_) return;
      layers = *std::move(pending_upload_);
      pending_upload_.reset();
      uploading_ = true;
    }
    const int step = layers.empty() ? 0 : layers[0].step();
    const absl::Status saved = SaveCheckpoint(std::move(layers));
    if (!saved.ok()) {
      GT_LOG(Warning) << "checkpoint of step " << step << " not saved: " << saved.message();
    }
    absl::MutexLock lock(&mu_);
    uploading_ = false;
  }
}

void CoordinatorClient::ReportEvent(const std::string& kind, const std::string& detail,
                                    const std::string& peer) {
  ReportEventOfEpoch(epoch_, kind, detail, peer);
}

void CoordinatorClient::ReportEventOfEpoch(uint64_t epoch, const std::string& kind,
                                           const std::string& detail, const std::string& peer) {
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(kControlRpcTimeout));
  v1::WorkerEvent event;
  event.set_worker_id(worker_id());
  event.set_kind(kind);
  event.set_detail(detail);
  event.set_peer(peer);
  event.set_epoch(epoch);
  v1::ReportAck ack;
  const grpc::Status status = stub_->ReportEvent(&context, event, &ack);
  if (!status.ok()) GT_LOG(Warning) << "event report failed: " << status.error_message();
}

absl::StatusOr<bool> CoordinatorClient::Heartbeat(uint64_t rss_bytes,
                                                  const v1::StageStats& stats) {
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(kControlRpcTimeout));
  v1::HeartbeatRequest request;
  request.set_worker_id(worker_id());
  request.set_rss_bytes(rss_bytes);
  request.set_step(step_);
  request.set_epoch(epoch_);
  *request.mutable_stats() = stats;
  pacer_.Observe(stats);
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [kind, seconds] : layer_timings_) {
      (*request.mutable_layer_seconds_per_sample())[kind] = seconds;
    }
  }
  if (prober_ != nullptr) {
    for (v1::ProbeResult& result : prober_->TakeResults()) {
      // A measure sends its payload from here: the uplink is at least that.
      if (result.measured() && result.rate_bps() > 0) pacer_.ObserveUplink(result.rate_bps() / 8);
      *request.add_probe_results() = std::move(result);
    }
    for (v1::AccessProbeResult& result : prober_->TakeAccessResults()) {
      if (result.measured() && result.uplink_bps() > 0) {
        pacer_.ObserveUplink(result.uplink_bps() / 8);
      }
      *request.add_access_probe_results() = std::move(result);
    }
  }
  v1::HeartbeatResponse response;
  const grpc::Status status = stub_->Heartbeat(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  if (prober_ != nullptr) {
    for (const v1::ProbeTask& task : response.probes()) prober_->Enqueue(task);
    if (response.has_access_probe()) prober_->EnqueueAccess(response.access_probe());
  }
  if (audit_work_ && (response.evidence_requests_size() > 0 || response.verify_audits_size() > 0)) {
    audit_work_(response);
  }
  return response.known();
}

void CoordinatorClient::SetLayerTimings(std::map<std::string, double> seconds_per_sample) {
  absl::MutexLock lock(&mu_);
  layer_timings_ = std::move(seconds_per_sample);
}

std::unique_ptr<grpc::ClientReader<v1::Plan>> CoordinatorClient::WatchPlan(
    grpc::ClientContext* context) {
  v1::WatchPlanRequest request;
  request.set_worker_id(worker_id());
  return stub_->WatchPlan(context, request);
}

void CoordinatorClient::ReportFinalStats(const v1::StageStats& stats) {
  (void)Heartbeat(ResidentBytes(), stats);
}

absl::Status CoordinatorClient::ReportDone(int step) {
  // Every step's report first: the coordinator counts them.
  if (!reports_.Flush(kFlushBeforeDone)) {
    GT_LOG(Warning) << "progress reports still pending after "
                    << absl::FormatDuration(kFlushBeforeDone) << "; reporting DONE anyway";
  }
  {
    // And the stage's last checkpoint: the job's end exports the newest
    // complete one, which must be this one.
    absl::MutexLock lock(&mu_);
    auto uploaded = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !pending_upload_.has_value() && !uploading_;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&uploaded), kFlushBeforeDone)) {
      GT_LOG(Warning) << "the last checkpoint is still uploading after "
                      << absl::FormatDuration(kFlushBeforeDone) << "; reporting DONE anyway";
    }
  }
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(kControlRpcTimeout));
  v1::DoneReport request;
  request.set_worker_id(worker_id());
  request.set_step(step);
  v1::ReportAck ack;
  return FromGrpcStatus(stub_->ReportDone(&context, request, &ack));
}

void CoordinatorClient::Leave() {
  reports_.Flush(absl::Seconds(2));  // a leaving worker's last steps, if it can
  grpc::ClientContext context;
  context.set_deadline(DeadlineFromNow(kControlRpcTimeout));
  v1::LeaveRequest request;
  request.set_worker_id(worker_id());
  v1::LeaveResponse response;
  stub_->Leave(&context, request, &response);
}

void CoordinatorClient::StepFinished(int step, double loss, int64_t samples) {
  v1::StepReport report;
  report.set_worker_id(worker_id());
  report.set_epoch(epoch_);
  report.set_step(step);
  report.set_loss(loss);
  report.set_samples(samples);
  // UNAVAILABLE: the coordinator is making a new plan (or restarting). A
  // pipeline that goes on through that plan keeps the step, so the report
  // must arrive; the steps after it wait behind it.
  reports_.PostRetrying(
      [this, report = std::move(report)] {
        grpc::ClientContext context;
        context.set_deadline(DeadlineFromNow(kControlRpcTimeout));
        v1::ReportAck ack;
        const grpc::Status status = stub_->ReportStep(&context, report, &ack);
        if (status.error_code() == grpc::StatusCode::UNAVAILABLE) return false;
        if (!status.ok()) {
          GT_LOG(Warning) << "step " << report.step()
                          << " report failed: " << status.error_message();
        }
        return true;
      },
      kRetryReportsFor);
}

void CoordinatorClient::FirstStageFinished(int step) {
  v1::StepReport report;
  report.set_worker_id(worker_id());
  report.set_epoch(epoch_);
  report.set_step(step);
  reports_.Post([this, report = std::move(report)] {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(kControlRpcTimeout));
    v1::ReportAck ack;
    const grpc::Status status = stub_->ReportStep(&context, report, &ack);
    if (!status.ok()) {
      GT_LOG(Warning) << "stage-0 step " << report.step()
                      << " report failed: " << status.error_message();
    }
  });
}

void CoordinatorClient::EvalFinished(int step, const EvalResult& result) {
  v1::EvalReport report;
  report.set_worker_id(worker_id());
  report.set_epoch(epoch_);
  report.set_step(step);
  report.set_val_loss(result.loss);
  report.set_has_accuracy(result.accuracy >= 0);
  report.set_accuracy(std::max(0.0, result.accuracy));
  report.set_samples(result.samples);
  GT_LOG(Info) << absl::StrFormat("eval at step %d: val_loss %.4f%s", step, result.loss,
                                  result.accuracy >= 0
                                      ? absl::StrFormat(" accuracy %.4f", result.accuracy)
                                      : "");
  reports_.Post([this, report = std::move(report)] {
    grpc::ClientContext context;
    context.set_deadline(DeadlineFromNow(kControlRpcTimeout));
    v1::ReportAck ack;
    const grpc::Status status = stub_->ReportEval(&context, report, &ack);
    if (!status.ok()) GT_LOG(Warning) << "eval report failed: " << status.error_message();
  });
}

}  // namespace geotrain
