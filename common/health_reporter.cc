#include "common/health_reporter.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "grpc/health/v1/health.pb.h"

namespace geotrain {

void EnableStandardServices() {
  static std::once_flag once;
  std::call_once(once, [] {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    // Links grpc/health/v1/health.proto's descriptor into the binary, so
    // that reflection can describe the health service gRPC serves.
    (void)grpc::health::v1::HealthCheckRequest::descriptor();
  });
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const std::string& listen) {
  EnableStandardServices();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("health: cannot listen on ", listen));
  }
  GT_LOG(Info) << "health (plaintext, health and reflection only) on port " << port << " ("
               << listen << ")";
  return server;
}

HealthReporter::HealthReporter(std::string service, std::string why)
    : service_(std::move(service)), why_(std::move(why)) {}

void HealthReporter::Attach(grpc::Server* server) {
  absl::MutexLock lock(&mu_);
  servers_.push_back(server);
  PublishLocked();
}

void HealthReporter::DetachAll() {
  absl::MutexLock lock(&mu_);
  servers_.clear();
}

void HealthReporter::Set(bool serving, absl::string_view why) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  const bool changed = serving != serving_;
  serving_ = serving;
  why_ = std::string(why);
  if (changed) {
    GT_LOG(Info) << "health: " << (serving ? "SERVING" : "NOT_SERVING") << " (" << why_ << ")";
  }
  PublishLocked();
}

void HealthReporter::ShutDown(absl::string_view why) {
  Set(false, why);
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  PublishLocked();
}

bool HealthReporter::serving() const {
  absl::MutexLock lock(&mu_);
  return serving_;
}

std::string HealthReporter::why() const {
  absl::MutexLock lock(&mu_);
  return why_;
}

void HealthReporter::PublishLocked() {
  for (grpc::Server* server : servers_) {
    grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
    if (health == nullptr) continue;  // EnableStandardServices() was not called
    health->SetServingStatus("", serving_);  // the whole server
    health->SetServingStatus(service_, serving_);
    health->SetServingStatus(kLivenessService, !shut_down_);
  }
}

}  // namespace geotrain
