// Conversion between absl::Status (domain code) and grpc::Status (the RPC
// boundary). Codes map one to one; messages are kept.
#ifndef GEOTRAIN_COMMON_GRPC_STATUS_H_
#define GEOTRAIN_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace geotrain {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_GRPC_STATUS_H_
