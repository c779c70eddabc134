// Join tokens: `gt1.<id>.<secret>.<ca sha256 hex>`.
//
// The id (6 characters of [a-z0-9]) names the token in `geotrain-ctl token
// list` and is not secret; the secret (32 characters of [a-z0-9], ~165
// bits) is stored only as its SHA-256; the last part is the fingerprint of
// the coordinator's CA certificate, so that a token alone lets a worker
// verify the coordinator (like kubeadm's --discovery-token-ca-cert-hash).
// Torch-free, no state.
#ifndef GEOTRAIN_COMMON_JOIN_TOKEN_H_
#define GEOTRAIN_COMMON_JOIN_TOKEN_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace geotrain {

inline constexpr size_t kTokenIdLength = 6;
inline constexpr size_t kTokenSecretLength = 32;

struct JoinToken {
  std::string id;
  std::string secret;
  std::string ca_fingerprint;  // "sha256:<64 hex>"
};

// INVALID_ARGUMENT (saying which part is wrong) unless `text` is exactly
// gt1.<id>.<secret>.<64 lowercase hex> (surrounding whitespace allowed).
absl::StatusOr<JoinToken> ParseJoinToken(absl::string_view text);
std::string FormatJoinToken(const JoinToken& token);

// A fresh id and secret (OpenSSL's RAND_bytes) for `ca_fingerprint`.
absl::StatusOr<JoinToken> NewJoinToken(const std::string& ca_fingerprint);

// `bytes` random bytes from OpenSSL's RAND_bytes as lowercase hex (a
// secret such as a relayed link's proofs). Aborts if OpenSSL has none.
std::string RandomHexSecret(size_t bytes);

// Hex SHA-256 of a secret, as stored.
std::string HashTokenSecret(absl::string_view secret);
// Constant-time comparison of two equal-length strings (false otherwise).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_JOIN_TOKEN_H_
