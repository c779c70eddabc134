// Dials a worker's Stage service and asks who answers (Stage.Probe), with a
// deadline: how the coordinator and peers find out whether a member's
// advertised address can be reached. Torch-free; thread-safe.
#ifndef GEOTRAIN_COMMON_STAGE_PROBE_H_
#define GEOTRAIN_COMMON_STAGE_PROBE_H_

#include <cstddef>
#include <string>
#include <vector>

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

// The most a Measure call may carry (the Stage service refuses more).
inline constexpr size_t kMaxMeasurePayloadBytes = 1 << 20;

struct LinkMeasurement {
  double rtt_s = 0;    // least of a few empty calls on one connection
  double rate_bps = 0; // payload bits / (its call's time - RTT)
};

// Connects as ProbeStage does, then times 3 empty Stage.Measure calls and
// one carrying `payload_bytes` (<= kMaxMeasurePayloadBytes): what a joiner's
// link to that member would see, bounded to those bytes and `deadline` in
// all. UNAVAILABLE as ProbeStage; INVALID_ARGUMENT for a payload too big.
absl::StatusOr<LinkMeasurement> MeasureStage(const std::string& address,
                                             const std::string& member_id,
                                             const TransportSecurity& security,
                                             absl::Duration deadline, size_t payload_bytes);

// A member to measure against, as ProbeStage names it.
struct MeasureTarget {
  std::string address;
  std::string member_id;
};

// The most peers one access measurement uses.
inline constexpr size_t kMaxAccessPeers = 4;

struct AccessMeasurement {
  double uplink_bps = 0;    // payload bits sent to all peers / the sends' time - RTT
  double downlink_bps = 0;  // payload bits fetched from all / the fetches' time - RTT
};

// This host's access link (its port, which every link of its shares):
// connects to every target as MeasureStage does, then sends `payload_bytes`
// (<= kMaxMeasurePayloadBytes) to all of them at once, and then has all of
// them send as many back at once (MeasureRequest.reply_bytes). Each
// target's port carries one transfer and this host's carries all, so with
// two or more targets the sums are this host's figures where its port is
// the narrowest part, and more than any one pair's where the pairs' paths
// are. Bounded by `deadline` in all. UNAVAILABLE as ProbeStage (naming the
// target); INVALID_ARGUMENT for no targets, more than kMaxAccessPeers, or a
// payload of 0 or too many bytes.
absl::StatusOr<AccessMeasurement> MeasureAccess(const std::vector<MeasureTarget>& targets,
                                                const TransportSecurity& security,
                                                absl::Duration deadline, size_t payload_bytes);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_STAGE_PROBE_H_
