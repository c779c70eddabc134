// Dials a worker's Stage service and asks who answers (Stage.Probe), with a
// deadline: how the coordinator and peers find out whether a member's
// advertised address can be reached. Torch-free; thread-safe.
#ifndef GEOTRAIN_COMMON_STAGE_PROBE_H_
#define GEOTRAIN_COMMON_STAGE_PROBE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport_security.h"

namespace geotrain {

// How long the answer took, or why there was none (UNAVAILABLE, in words:
// no answer within the deadline, refused, a TLS handshake that failed, or
// another worker answering). With TLS the answering certificate must name
// `member_id` (when not empty); a fresh connection is made every time.
absl::StatusOr<absl::Duration> ProbeStage(const std::string& address,
                                          const std::string& member_id,
                                          const TransportSecurity& security,
                                          absl::Duration deadline);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_STAGE_PROBE_H_
