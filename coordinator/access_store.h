// Join tokens and revoked worker identities, persisted in
// <state_dir>/access.textproto (a token's secret only as its SHA-256).
//
// A worker token buys one enrollment per use until it expires or is
// revoked; a viewer token only reads the status API. Worker ids are
// allocated here ("w<n>", never reused, also across restarts), so that two
// certificates never name the same worker.
// Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_ACCESS_STORE_H_
#define GEOTRAIN_COORDINATOR_ACCESS_STORE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

class AccessStore {
 public:
  using WallClock = std::function<absl::Time()>;
  // `ca_fingerprint`: what new tokens carry and presented ones must match.
  static absl::StatusOr<std::unique_ptr<AccessStore>> Open(const std::string& path,
                                                           std::string ca_fingerprint,
                                                           WallClock now = absl::Now);

  // The token's text is in the response, once; only its hash is kept.
  absl::StatusOr<v1::CreateTokenResponse> CreateToken(const v1::CreateTokenRequest& request);
  v1::ListTokensResponse ListTokens() const;
  // NOT_FOUND for an unknown id.
  absl::StatusOr<v1::TokenInfo> RevokeToken(const std::string& id_or_token);

  // Checks a presented token for `role` without using it up:
  // INVALID_ARGUMENT for a malformed one, UNAUTHENTICATED for an unknown id,
  // a wrong secret or another coordinator's CA, PERMISSION_DENIED for an
  // expired, revoked or used-up token or one of another role. Returns its id.
  absl::StatusOr<std::string> CheckToken(const std::string& token, v1::TokenRole role) const;
  // Checks a worker (or relay) token as CheckToken does, takes one use and
  // allocates a new worker id for it (one that `taken` says is free).
  absl::StatusOr<std::string> RedeemForWorker(const std::string& token,
                                              const std::function<bool(const std::string&)>& taken,
                                              std::string* token_id);

  absl::Status RevokeWorker(const std::string& worker_id);
  bool IsWorkerRevoked(const std::string& worker_id) const;
  // The newest `max` revoked identities.
  std::vector<std::string> RevokedWorkers(size_t max) const;
  // Whether this store gave out `worker_id` (enrolled with some token).
  bool IssuedWorker(const std::string& worker_id) const;
  // The role of the token `worker_id` enrolled with (UNSPECIFIED: none
  // known). A relay token's identities may only join as relays.
  v1::TokenRole RoleOfWorker(const std::string& worker_id) const;
  // The token a worker enrolled with ("" if none).
  std::string TokenOfWorker(const std::string& worker_id) const;

 private:
  AccessStore(std::string path, std::string ca_fingerprint, WallClock now)
      : path_(std::move(path)), ca_fingerprint_(std::move(ca_fingerprint)), now_(std::move(now)) {}
  absl::StatusOr<const v1::TokenRecord*> FindValidLocked(const std::string& token,
                                                         v1::TokenRole role) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // A write of the state as it is now: a copy and its sequence number,
  // taken under mu_; Write() then prints and persists it without mu_.
  struct PendingWrite {
    uint64_t sequence = 0;
    v1::AccessState state;
  };
  PendingWrite SnapshotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes `pending` unless a later snapshot (which holds every change in
  // it) was written already: writes are in order, and concurrent changes
  // share one. Returns once a state with `pending`'s changes is durable.
  absl::Status Write(const PendingWrite& pending) ABSL_LOCKS_EXCLUDED(mu_, write_mu_);

  const std::string path_;
  const std::string ca_fingerprint_;
  const WallClock now_;
  mutable absl::Mutex mu_;
  v1::AccessState state_ ABSL_GUARDED_BY(mu_);
  // state_.revoked_workers() as a set under a lock of its own: every
  // heartbeat asks IsWorkerRevoked, and at 10,000 members the readers of
  // mu_ queued behind the enrollments' writers (a convoy of 178 threads).
  mutable absl::Mutex revoked_mu_ ABSL_ACQUIRED_AFTER(mu_);
  absl::flat_hash_set<std::string> revoked_ ABSL_GUARDED_BY(revoked_mu_);
  uint64_t snapshots_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex write_mu_;
  uint64_t written_ ABSL_GUARDED_BY(write_mu_) = 0;  // the newest snapshot on disk
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_ACCESS_STORE_H_
