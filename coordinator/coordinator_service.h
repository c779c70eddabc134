// gRPC adapters for the Coordinator and Status services: they translate
// messages and statuses and call JobController, nothing else. Sync API: the
// control plane is small unary calls plus one plan watch per worker.
#ifndef GEOTRAIN_COORDINATOR_COORDINATOR_SERVICE_H_
#define GEOTRAIN_COORDINATOR_COORDINATOR_SERVICE_H_

#include "coordinator/job_controller.h"
#include "geotrain/v1/coordinator.grpc.pb.h"
#include "geotrain/v1/status.grpc.pb.h"

namespace geotrain {

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  explicit CoordinatorService(JobController* controller)
      : controller_(controller) {}

  grpc::Status Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context,
                         const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status WatchPlan(grpc::ServerContext* context,
                         const v1::WatchPlanRequest* request,
                         grpc::ServerWriter<v1::Plan>* writer) override;
  grpc::Status Leave(grpc::ServerContext* context,
                     const v1::LeaveRequest* request,
                     v1::LeaveResponse* response) override;
  grpc::Status ReportStep(grpc::ServerContext* context,
                          const v1::StepReport* request,
                          v1::ReportAck* response) override;
  grpc::Status ReportEval(grpc::ServerContext* context,
                          const v1::EvalReport* request,
                          v1::ReportAck* response) override;
  grpc::Status ReportDone(grpc::ServerContext* context,
                          const v1::DoneReport* request,
                          v1::ReportAck* response) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext* context,
                              grpc::ServerReader<v1::LayerCheckpoint>* reader,
                              v1::SaveCheckpointResponse* response) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext* context,
                              const v1::LoadCheckpointRequest* request,
                              v1::LayerCheckpoint* response) override;
  grpc::Status ReportEvent(grpc::ServerContext* context, const v1::WorkerEvent* request,
                           v1::ReportAck* response) override;

 private:
  JobController* controller_;  // not owned
};

class StatusService final : public v1::Status::Service {
 public:
  explicit StatusService(JobController* controller) : controller_(controller) {}
  grpc::Status GetClusterStatus(grpc::ServerContext* context,
                                const v1::ClusterStatusRequest* request,
                                v1::ClusterStatus* response) override;

 private:
  JobController* controller_;  // not owned
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_COORDINATOR_SERVICE_H_
