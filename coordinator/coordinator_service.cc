#include "coordinator/coordinator_service.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <optional>

#include "common/layer_state.h"
#include "coordinator/checkpoint_upload.h"
#include "coordinator/link_assigner.h"
#include "coordinator/model_export.h"

#include "coordinator/membership.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/rpc_options.h"
#include "common/transport_security.h"
#include "common/x509.h"

namespace geotrain {
namespace {

constexpr int64_t kRateBucketMs = 30000;
constexpr size_t kRevokedInPlan = 1000;

grpc::Status Refused(const absl::Status& status) { return ToGrpcStatus(status); }

}  // namespace

bool JoinRateLimiter::Admit(const std::string& source) {
  const int64_t bucket = clock_->NowMs() / kRateBucketMs;
  absl::MutexLock lock(&mu_);
  // Forget idle sources, so that the table stays small.
  if (windows_.size() > 10000) {
    for (auto it = windows_.begin(); it != windows_.end();) {
      it = it->second.bucket + 1 < bucket ? windows_.erase(it) : std::next(it);
    }
  }
  Window& w = windows_[source];
  if (w.bucket != bucket) {
    w.previous = w.bucket + 1 == bucket ? w.current : 0;
    w.current = 0;
    w.bucket = bucket;
  }
  if (w.current + w.previous >= per_minute_) return false;
  ++w.current;
  return true;
}

absl::StatusOr<std::string> CallerCheck::Worker(const grpc::ServerContextBase& context,
                                                const std::string& claimed) const {
  if (insecure()) return claimed;
  const std::string identity = PeerIdentity(context);
  if (identity.empty()) {
    return absl::UnauthenticatedError(
        "this call needs the worker's certificate: join with --token=TOKEN first");
  }
  if (identity == kAdminIdentity) {
    return absl::PermissionDeniedError("the admin credential is not a worker");
  }
  if (options_->access->IsWorkerRevoked(identity)) {
    return absl::PermissionDeniedError(absl::StrCat("worker ", identity, " was revoked"));
  }
  if (!claimed.empty() && claimed != identity) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the caller's certificate names worker ", identity, "; the request speaks for ", claimed));
  }
  return identity;
}

absl::Status CallerCheck::Admin(const grpc::ServerContextBase& context) const {
  if (insecure()) return absl::OkStatus();
  const std::string identity = PeerIdentity(context);
  if (identity == kAdminIdentity) return absl::OkStatus();
  if (identity.empty()) {
    return absl::UnauthenticatedError(
        "admin calls need the admin credential (--admin_credential=<state_dir>/tls/"
        "admin.credential)");
  }
  return absl::PermissionDeniedError(
      absl::StrCat("admin calls need the admin credential, not worker ", identity, "'s"));
}

absl::Status CallerCheck::Viewer(const grpc::ServerContextBase& context) const {
  if (insecure()) return absl::OkStatus();
  const std::string identity = PeerIdentity(context);
  if (identity == kAdminIdentity) return absl::OkStatus();
  if (!identity.empty()) {
    if (options_->access->IsWorkerRevoked(identity)) {
      return absl::PermissionDeniedError(absl::StrCat("worker ", identity, " was revoked"));
    }
    return absl::OkStatus();
  }
  auto token = context.client_metadata().find(kTokenMetadataKey);
  if (token == context.client_metadata().end()) {
    return absl::UnauthenticatedError(
        "status needs a credential: --admin_credential=FILE, a worker's, or a viewer token "
        "(--token=TOKEN from `geotrain-ctl token create --role=viewer`)");
  }
  absl::StatusOr<std::string> checked = options_->access->CheckToken(
      std::string(token->second.data(), token->second.size()), v1::TOKEN_ROLE_VIEWER);
  return checked.status();
}

bool InFlightLimit::Acquire(const std::string& key) {
  absl::MutexLock lock(&mu_);
  int& mine = held_[key];
  if (mine >= per_key_ || all_ >= total_) {
    if (mine == 0) held_.erase(key);
    return false;
  }
  ++mine;
  ++all_;
  return true;
}

void InFlightLimit::Release(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(key);
  if (it == held_.end()) return;
  --all_;
  if (--it->second == 0) held_.erase(it);
}

namespace {

// Holds a place in an InFlightLimit for one call.
class InFlight {
 public:
  InFlight(InFlightLimit& limit, std::string key)
      : limit_(limit), key_(std::move(key)), held_(limit.Acquire(key_)) {}
  ~InFlight() {
    if (held_) limit_.Release(key_);
  }
  bool held() const { return held_; }

 private:
  InFlightLimit& limit_;
  const std::string key_;
  const bool held_;
};

grpc::Status Busy(const std::string& what) {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, what);
}

}  // namespace

grpc::Status CoordinatorService::Admit(JoinRateLimiter& limiter, const std::string& key,
                                       const char* what) {
  if (limiter.Admit(key)) return grpc::Status::OK;
  GT_LOG(Warning) << "refused " << what << " " << key.substr(0, 128) << ": over "
                  << options_.joins_per_source_per_minute << " per minute";
  return Busy(absl::StrCat("more than ", options_.joins_per_source_per_minute, " ", what, " ",
                           key.substr(0, 128), " a minute; try again later"));
}

grpc::Status CoordinatorService::Enroll(grpc::ServerContext* context,
                                        const v1::EnrollRequest* request,
                                        v1::EnrollResponse* response) {
  if (caller_.insecure()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this coordinator runs --insecure: join without a token");
  }
  const std::string source = PeerHost(context->peer());
  InFlight anonymous(anonymous_, source);
  if (!anonymous.held()) {
    return Busy(absl::StrCat("too many calls without a certificate in flight (",
                             options_.anonymous_calls_per_source, " from one host, ",
                             options_.max_anonymous_calls, " in all)"));
  }
  // Nothing is used up by a token that fails, or by a CSR that would.
  absl::StatusOr<std::string> checked =
      options_.access->CheckToken(request->token(), v1::TOKEN_ROLE_WORKER);
  if (!checked.ok()) {
    // Only failures count against the source: a stranger behind a NAT
    // spends its own budget, never that of the volunteers beside it.
    if (grpc::Status admitted = Admit(refusals_, source, "refused enrollments from");
        !admitted.ok()) {
      return admitted;
    }
    GT_LOG(Warning) << "refused an enrollment from " << context->peer() << ": "
                    << checked.status().message();
    return Refused(checked.status());
  }
  if (grpc::Status admitted = Admit(enrolls_, *checked, "enrollments with token");
      !admitted.ok()) {
    return admitted;
  }
  if (absl::Status csr = CheckCsr(request->csr_pem()); !csr.ok()) return Refused(csr);
  if (absl::Status name = ValidateWorkerName(request->name()); !name.ok()) return Refused(name);
  std::string token_id;
  absl::StatusOr<std::string> worker_id = options_.access->RedeemForWorker(
      request->token(), [this](const std::string& id) { return options_.controller->KnowsWorker(id); },
      &token_id);
  if (!worker_id.ok()) return Refused(worker_id.status());
  absl::StatusOr<std::string> certificate =
      options_.authority->IssueWorkerCertificate(request->csr_pem(), *worker_id);
  if (!certificate.ok()) return Refused(certificate.status());
  options_.controller->RecordEnrollment(*worker_id, request->name(), token_id);
  response->set_worker_id(*worker_id);
  response->set_certificate_pem(*certificate);
  response->set_ca_pem(options_.authority->cluster_ca_pem());
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Join(grpc::ServerContext* context,
                                      const v1::JoinRequest* request,
                                      v1::JoinResponse* response) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, "");
  if (!worker.ok()) return Refused(worker.status());
  // By identity: each volunteer's budget is its own, whatever NAT it shares
  // (insecure, ids are not certified: by source host).
  if (grpc::Status admitted =
          caller_.insecure() ? Admit(joins_, PeerHost(context->peer()), "joins from")
                             : Admit(joins_, *worker, "joins by");
      !admitted.ok()) {
    return admitted;
  }
  if (absl::Status valid = ValidateJoinRequest(*request); !valid.ok()) return Refused(valid);
  if (!caller_.insecure()) {
    // Relays carry other workers' links: only an admin's relay token makes
    // one, and such an identity is nothing else.
    const bool relay_identity = options_.access->RoleOfWorker(*worker) == v1::TOKEN_ROLE_RELAY;
    const bool as_relay = request->role() == v1::MEMBER_ROLE_RELAY;
    if (as_relay && !relay_identity) {
      return Refused(absl::PermissionDeniedError(absl::StrCat(
          worker->substr(0, 128), " enrolled with a worker token; a relay needs a relay token "
          "(geotrain-ctl token create --role=relay)")));
    }
    if (!as_relay && relay_identity) {
      return Refused(absl::PermissionDeniedError(absl::StrCat(
          worker->substr(0, 128), " enrolled with a relay token: it may join only as a relay")));
    }
  }
  // Dialled back before it is admitted, so that its first plan already
  // knows who must dial whom.
  v1::Reachability reachability;
  if (options_.prober != nullptr) {
    reachability = options_.prober->Probe(request->address(), *worker, request->role());
  }
  absl::StatusOr<v1::JoinResponse> joined =
      options_.controller->Join(*request, *worker, reachability);
  if (!joined.ok()) return Refused(joined.status());
  if (context->IsCancelled()) {
    // The caller gave up (its deadline passed while the coordinator was
    // busy): the answer would go nowhere, so the member it would have been
    // goes too. Its retry joins afresh, or finds the member a retry that
    // overtook this attempt was given (same session).
    options_.controller->AbandonJoin(joined->worker_id(), request->session_id());
    return grpc::Status(grpc::StatusCode::CANCELLED, "the caller gave up on the join");
  }
  *response = *std::move(joined);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::HandleHeartbeat(grpc::ServerContext* context,
                                                 const v1::HeartbeatRequest& request,
                                                 v1::HeartbeatResponse* response) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request.worker_id());
  if (!worker.ok()) return Refused(worker.status());
  if (absl::Status valid = ValidateHeartbeatRequest(request); !valid.ok()) return Refused(valid);
  v1::HeartbeatRequest checked = request;
  checked.set_worker_id(*worker);
  response->set_known(options_.controller->Heartbeat(checked, response));
  return grpc::Status::OK;
}

CoordinatorService::CoordinatorService(CoordinatorServiceOptions options)
    : options_(options),
      caller_(&options_),
      joins_(options.clock, options.joins_per_source_per_minute),
      enrolls_(options.clock, options.joins_per_source_per_minute),
      refusals_(options.clock, options.joins_per_source_per_minute),
      watches_(options.watches_per_identity, options.max_watches),
      anonymous_(options.anonymous_calls_per_source, options.max_anonymous_calls),
      plan_streams_(std::make_shared<PlanStreams>(
          [this](const v1::Plan& plan, const std::string& worker) {
            // Each link's rendezvous goes only to its ends and its relay;
            // the revoked identities go to everyone, whose peers refuse them.
            v1::Plan view = PlanViewFor(plan, worker);
            if (!caller_.insecure()) {
              for (std::string& id : options_.access->RevokedWorkers(kRevokedInPlan)) {
                view.add_revoked_workers(std::move(id));
              }
            }
            return view;
          },
          [this](const grpc::ServerContext& context, const v1::WatchPlanRequest& request,
                 std::string* worker) -> grpc::Status {
            absl::StatusOr<std::string> caller = caller_.Worker(context, request.worker_id());
            if (!caller.ok()) return Refused(caller.status());
            // A few streams per identity, a bound in all.
            if (!watches_.Acquire(*caller)) {
              return Busy(absl::StrCat(caller->substr(0, 128), " holds ",
                                       options_.watches_per_identity,
                                       " plan streams already (or the coordinator its ",
                                       options_.max_watches, ")"));
            }
            *worker = *std::move(caller);
            return grpc::Status::OK;
          },
          [this](const std::string& worker) { watches_.Release(worker); },
          [controller = options.controller] { return controller->VisiblePlan(); })),
      heartbeats_(options.heartbeat_threads,
                  [this](grpc::ServerContext* context, const v1::HeartbeatRequest& request,
                         v1::HeartbeatResponse* response) {
                    return HandleHeartbeat(context, request, response);
                  }) {
  // Plans are pushed from the publisher's notification, not polled.
  std::weak_ptr<PlanStreams> streams = plan_streams_;
  options_.controller->AddPlanListener([streams](const PlanPublisher::PlanPtr& plan) {
    if (std::shared_ptr<PlanStreams> open = streams.lock()) open->Publish(plan);
  });
}

void CoordinatorService::AttachAsyncMethods(grpc::ServerBuilder* builder) {
  plan_streams_->Attach(builder);
  heartbeats_.Attach(builder);
}

void CoordinatorService::StartAsyncMethods() {
  plan_streams_->Start([this](grpc::ServerContext* context, v1::WatchPlanRequest* request,
                              grpc::ServerAsyncWriter<v1::Plan>* writer,
                              grpc::ServerCompletionQueue* queue, void* tag) {
    RequestWatchPlan(context, request, writer, queue, queue, tag);
  });
  heartbeats_.Start([this](grpc::ServerContext* context, v1::HeartbeatRequest* request,
                           grpc::ServerAsyncResponseWriter<v1::HeartbeatResponse>* responder,
                           grpc::ServerCompletionQueue* queue, void* tag) {
    RequestHeartbeat(context, request, responder, queue, queue, tag);
  });
}

void CoordinatorService::StopAsyncMethods() {
  plan_streams_->Stop();
  heartbeats_.Stop();
}

grpc::Status CoordinatorService::Leave(grpc::ServerContext* context,
                                       const v1::LeaveRequest* request, v1::LeaveResponse*) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request->worker_id());
  if (!worker.ok()) return Refused(worker.status());
  options_.controller->Leave(*worker);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ReportStep(grpc::ServerContext* context,
                                            const v1::StepReport* request, v1::ReportAck*) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request->worker_id());
  if (!worker.ok()) return Refused(worker.status());
  v1::StepReport checked = *request;
  checked.set_worker_id(*worker);
  return ToGrpcStatus(options_.controller->ReportStep(checked));
}

grpc::Status CoordinatorService::ReportEval(grpc::ServerContext* context,
                                            const v1::EvalReport* request, v1::ReportAck*) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request->worker_id());
  if (!worker.ok()) return Refused(worker.status());
  v1::EvalReport checked = *request;
  checked.set_worker_id(*worker);
  return ToGrpcStatus(options_.controller->ReportEval(checked));
}

grpc::Status CoordinatorService::ReportDone(grpc::ServerContext* context,
                                            const v1::DoneReport* request, v1::ReportAck*) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request->worker_id());
  if (!worker.ok()) return Refused(worker.status());
  v1::DoneReport checked = *request;
  checked.set_worker_id(*worker);
  return ToGrpcStatus(options_.controller->ReportDone(checked));
}

grpc::Status CoordinatorService::SaveCheckpoint(grpc::ServerContext* context,
                                                grpc::ServerReader<v1::LayerStateChunk>* reader,
                                                v1::SaveCheckpointResponse* response) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, "");
  if (!worker.ok()) return Refused(worker.status());
  std::unique_ptr<CheckpointUpload> upload;
  std::unique_ptr<LayerStateReceiver> receiver;
  v1::LayerStateChunk chunk;
  while (reader->Read(&chunk)) {
    if (upload == nullptr) {
      // Insecure: the uploader is whoever the first header names.
      if (caller_.insecure()) *worker = chunk.header().worker_id();
      upload = std::make_unique<CheckpointUpload>(options_.controller, *worker);
      receiver = std::make_unique<LayerStateReceiver>(upload.get(), kMaxLayerStateBytes);
    }
    if (absl::Status added = receiver->Add(chunk); !added.ok()) return ToGrpcStatus(added);
    response->set_layers_saved(receiver->layers_done());
  }
  if (receiver != nullptr) {
    if (absl::Status finished = receiver->Finish(); !finished.ok()) {
      return ToGrpcStatus(finished);
    }
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::LoadCheckpoint(grpc::ServerContext* context,
                                                const v1::LoadCheckpointRequest* request,
                                                grpc::ServerWriter<v1::LayerStateChunk>* writer) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request->worker_id());
  if (!worker.ok()) return Refused(worker.status());
  if (request->probe()) {
    absl::StatusOr<v1::LayerCheckpoint> newest =
        options_.controller->checkpoint_gate().Load(*worker, request->layer(), /*probe=*/true);
    if (!newest.ok()) return ToGrpcStatus(newest.status());
    v1::LayerStateChunk chunk;
    *chunk.mutable_header() = *std::move(newest);
    chunk.set_last(true);
    writer->Write(chunk);
    return grpc::Status::OK;
  }
  return ToGrpcStatus(SendCheckpoint(
      *options_.controller, *worker, request->layer(),
      request->has_step() ? std::optional<int>(request->step()) : std::nullopt,
      [writer](const v1::LayerStateChunk& chunk) { return writer->Write(chunk); }));
}

grpc::Status CoordinatorService::ReportEvent(grpc::ServerContext* context,
                                             const v1::WorkerEvent* request, v1::ReportAck*) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request->worker_id());
  if (!worker.ok()) return Refused(worker.status());
  v1::WorkerEvent checked = *request;
  checked.set_worker_id(*worker);
  return ToGrpcStatus(options_.controller->RecordWorkerEvent(checked));
}

grpc::Status AuditService::UploadEvidence(grpc::ServerContext* context,
                                          const v1::AuditEvidence* request, v1::ReportAck*) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request->worker_id());
  if (!worker.ok()) return Refused(worker.status());
  return ToGrpcStatus(options_.controller->AcceptAuditEvidence(*worker, *request));
}

grpc::Status AuditService::FetchAudit(grpc::ServerContext* context,
                                      const v1::FetchAuditRequest* request,
                                      v1::AuditBundle* response) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request->worker_id());
  if (!worker.ok()) return Refused(worker.status());
  absl::StatusOr<v1::AuditBundle> bundle =
      options_.controller->FetchAudit(*worker, request->audit_id());
  if (!bundle.ok()) return Refused(bundle.status());
  *response = *std::move(bundle);
  return grpc::Status::OK;
}

grpc::Status AuditService::ReportVerdict(grpc::ServerContext* context,
                                         const v1::AuditVerdict* request, v1::ReportAck*) {
  absl::StatusOr<std::string> worker = caller_.Worker(*context, request->worker_id());
  if (!worker.ok()) return Refused(worker.status());
  return ToGrpcStatus(options_.controller->AcceptAuditVerdict(*worker, *request));
}

grpc::Status AdminService::CheckAdmin(const grpc::ServerContext& context) const {
  if (caller_.insecure()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this coordinator runs --insecure: it has no tokens or certificates");
  }
  return ToGrpcStatus(caller_.Admin(context));
}

grpc::Status AdminService::CreateToken(grpc::ServerContext* context,
                                       const v1::CreateTokenRequest* request,
                                       v1::CreateTokenResponse* response) {
  if (grpc::Status admin = CheckAdmin(*context); !admin.ok()) return admin;
  absl::StatusOr<v1::CreateTokenResponse> created = options_.access->CreateToken(*request);
  if (!created.ok()) return Refused(created.status());
  *response = *std::move(created);
  options_.controller->RecordAdminEvent(
      "token_created", absl::StrCat("token ", response->info().id(), " (",
                                    response->info().label(), ")"));
  return grpc::Status::OK;
}

grpc::Status AdminService::ListTokens(grpc::ServerContext* context,
                                      const v1::ListTokensRequest*,
                                      v1::ListTokensResponse* response) {
  if (grpc::Status admin = CheckAdmin(*context); !admin.ok()) return admin;
  *response = options_.access->ListTokens();
  return grpc::Status::OK;
}

grpc::Status AdminService::RevokeToken(grpc::ServerContext* context,
                                       const v1::RevokeTokenRequest* request,
                                       v1::RevokeTokenResponse* response) {
  if (grpc::Status admin = CheckAdmin(*context); !admin.ok()) return admin;
  absl::StatusOr<v1::TokenInfo> revoked = options_.access->RevokeToken(request->id_or_token());
  if (!revoked.ok()) return Refused(revoked.status());
  *response->mutable_info() = *revoked;
  options_.controller->RecordAdminEvent(
      "token_revoked",
      absl::StrCat("token ", revoked->id(),
                   request->keep_workers() || revoked->workers().empty()
                       ? ""
                       : absl::StrCat(" and its workers ", absl::StrJoin(revoked->workers(), ","))));
  if (request->keep_workers()) return grpc::Status::OK;
  for (const std::string& worker : revoked->workers()) {
    if (absl::Status out = options_.access->RevokeWorker(worker); !out.ok()) return Refused(out);
    options_.controller->RevokeWorker(worker);
    response->add_revoked_workers(worker);
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::ExportModel(grpc::ServerContext* context,
                                       const v1::ExportModelRequest* request,
                                       grpc::ServerWriter<v1::ExportFileChunk>* writer) {
  if (!caller_.insecure()) {
    if (absl::Status admin = caller_.Admin(*context); !admin.ok()) return Refused(admin);
  }
  JobController& controller = *options_.controller;
  // Written to a private directory under the state dir, streamed, removed.
  static std::atomic<int> exports{0};
  const std::string dir =
      absl::StrCat(controller.state_dir(), "/export-", getpid(), "-", exports++);
  ModelExportOptions export_options;
  export_options.out_dir = dir;
  if (request->max_shard_bytes() > 0) export_options.max_shard_bytes = request->max_shard_bytes();
  absl::StatusOr<ModelExport> exported =
      geotrain::ExportModel(controller.job(), controller.checkpoints(), export_options);
  grpc::Status status = grpc::Status::OK;
  if (!exported.ok()) {
    status = ToGrpcStatus(exported.status());
  } else {
    std::string buffer(kLayerStateChunkBytes, '\0');
    for (const std::string& file : exported->files) {
      std::ifstream in(dir + "/" + file, std::ios::binary);
      in.seekg(0, std::ios::end);
      const uint64_t size = static_cast<uint64_t>(in.tellg());
      in.seekg(0);
      uint64_t sent = 0;
      bool first = true;
      do {
        v1::ExportFileChunk chunk;
        if (first) {
          chunk.set_file(file);
          chunk.set_size(size);
          chunk.set_step(exported->step);
          first = false;
        }
        in.read(buffer.data(), static_cast<std::streamsize>(
                                   std::min<uint64_t>(buffer.size(), size - sent)));
        const auto n = static_cast<size_t>(in.gcount());
        if (n == 0 && sent < size) {
          status = grpc::Status(grpc::StatusCode::INTERNAL, "export file shrank while read");
          break;
        }
        chunk.set_data(buffer.data(), n);
        sent += n;
        chunk.set_last(sent == size);
        if (!writer->Write(chunk)) {
          status = grpc::Status(grpc::StatusCode::CANCELLED, "the reader went away");
          break;
        }
      } while (sent < size);
      if (!status.ok()) break;
    }
    controller.RecordAdminEvent(
        status.ok() ? "exported" : "export_failed",
        absl::StrCat(exported->parameters, " parameters of step ", exported->step,
                     " to geotrain-ctl", status.ok() ? "" : ": " + status.error_message()));
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return status;
}

grpc::Status AdminService::RevokeWorker(grpc::ServerContext* context,
                                        const v1::RevokeWorkerRequest* request,
                                        v1::RevokeWorkerResponse* response) {
  if (grpc::Status admin = CheckAdmin(*context); !admin.ok()) return admin;
  // Any identity the coordinator issued, whether it ever joined or not.
  if (!options_.controller->KnowsWorker(request->worker_id()) &&
      !options_.access->IssuedWorker(request->worker_id())) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("no worker '", request->worker_id().substr(0, 128), "'"));
  }
  if (absl::Status revoked = options_.access->RevokeWorker(request->worker_id()); !revoked.ok()) {
    return Refused(revoked);
  }
  response->set_was_live(options_.controller->RevokeWorker(request->worker_id()));
  return grpc::Status::OK;
}

grpc::Status StatusService::GetClusterStatus(grpc::ServerContext* context,
                                             const v1::ClusterStatusRequest* request,
                                             v1::ClusterStatus* response) {
  const bool anonymous = !caller_.insecure() && PeerIdentity(*context).empty();
  std::optional<InFlight> in_flight;
  if (anonymous) in_flight.emplace(anonymous_, PeerHost(context->peer()));
  if (anonymous && !in_flight->held()) {
    return Busy("too many status calls without a certificate in flight; try again");
  }
  if (absl::Status viewer = caller_.Viewer(*context); !viewer.ok()) return Refused(viewer);
  absl::StatusOr<v1::ClusterStatus> status = options_.controller->Status(*request);
  if (!status.ok()) return Refused(status.status());
  *response = *std::move(status);
  response->set_security(caller_.insecure()
                             ? "insecure (plaintext, no authentication)"
                             : absl::StrCat("tls, CA ",
                                            options_.authority->serving_ca_fingerprint()));
  if (!caller_.insecure()) {
    for (v1::WorkerStatus& w : *response->mutable_workers()) {
      w.set_token_id(options_.access->TokenOfWorker(w.id()));
    }
  }
  return grpc::Status::OK;
}

}  // namespace geotrain
