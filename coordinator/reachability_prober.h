// Dials a joining member's advertised address back, as a peer would, so
// that the plan knows who can accept links (and the joiner learns at once,
// in words it can act on, when it cannot). Workers are probed with the
// Stage service's Probe call over TLS, the answering certificate having to
// name the joiner; relays with their plain-TCP greeting. Every probe has a
// deadline. Thread-safe (no state beyond its options).
#ifndef GEOTRAIN_COORDINATOR_REACHABILITY_PROBER_H_
#define GEOTRAIN_COORDINATOR_REACHABILITY_PROBER_H_

#include <string>

#include "absl/time/time.h"
#include "common/transport_security.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct ReachabilityProberOptions {
  // The coordinator's own certificate (clientAuth) and the cluster CA;
  // insecure: plaintext probes.
  TransportSecurity security;
  absl::Duration deadline = absl::Seconds(2);
  bool enabled = true;  // false: every probe is "not probed" (taken as reachable)
};

class ReachabilityProber {
 public:
  explicit ReachabilityProber(ReachabilityProberOptions options) : options_(std::move(options)) {}

  // `member_id`: the id the answering certificate must name ("" when
  // insecure and not known yet: any worker may answer).
  v1::Reachability Probe(const std::string& address, const std::string& member_id,
                         v1::MemberRole role) const;

 private:
  v1::Reachability ProbeWorker(const std::string& address, const std::string& member_id) const;
  v1::Reachability ProbeRelay(const std::string& address) const;

  const ReachabilityProberOptions options_;
};

// The advice a member gets when its address cannot be dialled.
std::string UnreachableAdvice(const std::string& address, const std::string& reason);

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_REACHABILITY_PROBER_H_
