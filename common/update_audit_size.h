// Which stages' updates spot checks can audit (docs/verification.md,
// "Update audits during a job"): an update audit's weights and optimizer
// state before the update and its weights after go up in one call, within
// the coordinator's message bound, until evidence is streamed. The
// coordinator draws only those; a worker keeps optimizer state for only
// those.
#ifndef GEOTRAIN_COMMON_UPDATE_AUDIT_SIZE_H_
#define GEOTRAIN_COMMON_UPDATE_AUDIT_SIZE_H_

#include <cstdint>

#include "common/rpc_options.h"
#include "geotrain/v1/job.pb.h"

namespace geotrain {

// Bytes an update audit carries per parameter: the weights and optimizer
// state before (AdamW: two moments; SGD: at most one buffer) and the same
// after (the state after is held to its commitment too), float32.
inline uint64_t UpdateAuditBytesPerParameter(const v1::Optimizer& optimizer) {
  return optimizer.kind() == v1::Optimizer::KIND_SGD ? 16 : 24;
}

// What those may come to: three quarters of one call, leaving room for the
// step's messages.
inline constexpr uint64_t kMaxUpdateAuditStateBytes =
    static_cast<uint64_t>(kCoordinatorMaxReceiveBytes) * 3 / 4;

inline bool UpdateAuditFits(uint64_t parameters, const v1::Optimizer& optimizer) {
  return parameters * UpdateAuditBytesPerParameter(optimizer) <= kMaxUpdateAuditStateBytes;
}

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_UPDATE_AUDIT_SIZE_H_
