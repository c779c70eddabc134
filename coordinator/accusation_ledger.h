// The books on link_lost accusations: a worker may accuse a neighbour of a
// lost link once per lease; each accusation is confirmed when the accused
// stops heartbeating, and counted against the accuser when the accused
// kept heartbeating for two leases after it. An accuser with
// kUnconfirmedToSuspect unconfirmed accusations is suspected: its
// accusations no longer count. No I/O and no clock of its own (the caller
// passes the time). Thread-compatible.
#ifndef GEOTRAIN_COORDINATOR_ACCUSATION_LEDGER_H_
#define GEOTRAIN_COORDINATOR_ACCUSATION_LEDGER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/membership.h"

namespace geotrain {

class AccusationLedger {
 public:
  static constexpr int kUnconfirmedToSuspect = 2;

  explicit AccusationLedger(int64_t lease_ms) : lease_ms_(lease_ms) {}

  // OK when `accuser` may accuse now: PERMISSION_DENIED when it is
  // suspected, RESOURCE_EXHAUSTED when it accused within the last lease.
  // The message says why.
  absl::Status MayAccuse(const std::string& accuser, const std::string& accused,
                         int64_t now_ms) const;
  // An accusation that counted (after MayAccuse).
  void Record(const std::string& accuser, const std::string& accused, int64_t now_ms);

  struct Suspicion {
    std::string accuser;
    std::string why;
  };
  // Settles the accusations two leases old against the members' records
  // (an accused that is gone confirms it). Unconfirmed ones count only
  // when callers are authenticated (otherwise anyone could make anyone
  // suspected). Returns the accusers newly suspected.
  std::vector<Suspicion> Review(const std::vector<WorkerRecord>& members, int64_t now_ms,
                                bool authenticated_callers);

  // Why `worker_id` is suspected; nullopt when it is not.
  std::optional<std::string> SuspicionOf(const std::string& worker_id) const;

 private:
  struct Pending {
    std::string accuser;
    int64_t at_ms = 0;
  };
  const int64_t lease_ms_;
  std::map<std::string, int64_t> last_accusation_ms_;  // per accuser
  std::map<std::string, Pending> pending_;             // per accused
  std::map<std::string, int> unconfirmed_;             // per accuser
  std::map<std::string, std::string> suspected_;       // accuser -> why
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_ACCUSATION_LEDGER_H_
