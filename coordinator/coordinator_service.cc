#include "coordinator/coordinator_service.h"

#include "common/grpc_status.h"

namespace geotrain {

grpc::Status CoordinatorService::Join(grpc::ServerContext*,
                                      const v1::JoinRequest* request,
                                      v1::JoinResponse* response) {
  if (request->address().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "join without an address peers can dial");
  }
  *response = controller_->Join(*request);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext*,
                                           const v1::HeartbeatRequest* request,
                                           v1::HeartbeatResponse* response) {
  response->set_known(controller_->Heartbeat(*request));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::WatchPlan(grpc::ServerContext* context,
                                           const v1::WatchPlanRequest*,
                                           grpc::ServerWriter<v1::Plan>* writer) {
  uint64_t sent_epoch = 0;
  while (!context->IsCancelled()) {
    std::optional<v1::Plan> plan =
        controller_->WaitForPlan(sent_epoch, absl::Milliseconds(500));
    if (!plan.has_value()) {
      if (controller_->done()) return grpc::Status::OK;
      if (controller_->shutting_down()) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down");
      }
      continue;
    }
    if (!writer->Write(*plan)) return grpc::Status::CANCELLED;
    sent_epoch = plan->epoch();
    if (plan->job_done()) return grpc::Status::OK;
  }
  return grpc::Status::CANCELLED;
}

grpc::Status CoordinatorService::Leave(grpc::ServerContext*,
                                       const v1::LeaveRequest* request,
                                       v1::LeaveResponse*) {
  controller_->Leave(request->worker_id());
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ReportStep(grpc::ServerContext*,
                                            const v1::StepReport* request,
                                            v1::ReportAck*) {
  return ToGrpcStatus(controller_->ReportStep(*request));
}

grpc::Status CoordinatorService::ReportEval(grpc::ServerContext*,
                                            const v1::EvalReport* request,
                                            v1::ReportAck*) {
  return ToGrpcStatus(controller_->ReportEval(*request));
}

grpc::Status CoordinatorService::ReportDone(grpc::ServerContext*,
                                            const v1::DoneReport* request,
                                            v1::ReportAck*) {
  return ToGrpcStatus(controller_->ReportDone(*request));
}

grpc::Status CoordinatorService::SaveCheckpoint(grpc::ServerContext*,
                                                grpc::ServerReader<v1::LayerCheckpoint>* reader,
                                                v1::SaveCheckpointResponse* response) {
  v1::LayerCheckpoint checkpoint;
  while (reader->Read(&checkpoint)) {
    if (absl::Status saved = controller_->SaveCheckpoint(checkpoint); !saved.ok()) {
      return ToGrpcStatus(saved);
    }
    response->set_layers_saved(response->layers_saved() + 1);
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::LoadCheckpoint(grpc::ServerContext*,
                                                const v1::LoadCheckpointRequest* request,
                                                v1::LayerCheckpoint* response) {
  absl::StatusOr<v1::LayerCheckpoint> checkpoint =
      controller_->LoadCheckpoint(request->worker_id(), request->layer());
  if (!checkpoint.ok()) return ToGrpcStatus(checkpoint.status());
  *response = *std::move(checkpoint);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ReportEvent(grpc::ServerContext*, const v1::WorkerEvent* request,
                                             v1::ReportAck*) {
  if (request->kind().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "event without a kind");
  }
  controller_->RecordWorkerEvent(*request);
  return grpc::Status::OK;
}

grpc::Status StatusService::GetClusterStatus(grpc::ServerContext*,
                                             const v1::ClusterStatusRequest*,
                                             v1::ClusterStatus* response) {
  *response = controller_->Status();
  return grpc::Status::OK;
}

}  // namespace geotrain
