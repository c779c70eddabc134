#include "coordinator/access_store.h"

#include <google/protobuf/text_format.h>

#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/files.h"
#include "common/join_token.h"
#include "common/status_macros.h"

namespace geotrain {
namespace {

constexpr size_t kMaxLabelBytes = 128;
constexpr int64_t kMaxTtlS = 365LL * 24 * 3600;
constexpr int64_t kDefaultTtlS = 24 * 3600;
// Tokens and revocations kept; expired tokens are pruned first.
constexpr int kMaxTokens = 10000;

std::string RoleName(v1::TokenRole role) {
  return role == v1::TOKEN_ROLE_VIEWER ? "viewer" : role == v1::TOKEN_ROLE_RELAY ? "relay" : "worker";
}

}  // namespace

absl::StatusOr<std::unique_ptr<AccessStore>> AccessStore::Open(const std::string& path,
                                                               std::string ca_fingerprint,
                                                               WallClock now) {
  auto store = std::unique_ptr<AccessStore>(
      new AccessStore(path, std::move(ca_fingerprint), std::move(now)));
  if (std::filesystem::exists(path)) {
    absl::StatusOr<std::string> text = ReadFileBounded(path, 64 << 20);
    if (!text.ok()) return text.status();
    absl::MutexLock lock(&store->mu_);
    if (!google::protobuf::TextFormat::ParseFromString(*text, &store->state_)) {
      return absl::DataLossError(absl::StrCat(path, " does not parse; the tokens and worker "
                                              "revocations in it cannot be trusted"));
    }
    absl::MutexLock revoked(&store->revoked_mu_);
    for (const std::string& id : store->state_.revoked_workers()) store->revoked_.insert(id);
  }
  return store;
}

AccessStore::PendingWrite AccessStore::SnapshotLocked() {
  PendingWrite pending;
  pending.sequence = ++snapshots_;
  pending.state = state_;
  return pending;
}

absl::Status AccessStore::Write(const PendingWrite& pending) {
  absl::MutexLock lock(&write_mu_);
  if (written_ >= pending.sequence) return absl::OkStatus();
  std::string text;
  google::protobuf::TextFormat::PrintToString(pending.state, &text);
  RETURN_IF_ERROR(WriteFileAtomically(path_, text, 0600));
  written_ = pending.sequence;
  return absl::OkStatus();
}

absl::StatusOr<v1::CreateTokenResponse> AccessStore::CreateToken(
    const v1::CreateTokenRequest& request) {
  if (request.ttl_s() < 0 || request.ttl_s() > kMaxTtlS) {
    return absl::InvalidArgumentError(
        absl::StrCat("token ttl ", request.ttl_s(), " s is outside [0, 1 year]"));
  }
  if (request.uses() < 0) return absl::InvalidArgumentError("negative token uses");
  if (request.label().size() > kMaxLabelBytes) {
    return absl::InvalidArgumentError("token label longer than 128 bytes");
  }
  absl::StatusOr<JoinToken> token = NewJoinToken(ca_fingerprint_);
  if (!token.ok()) return token.status();
  const int64_t now_s = absl::ToUnixSeconds(now_());
  v1::CreateTokenResponse response;
  PendingWrite pending;
  {
    absl::MutexLock lock(&mu_);
    // Expired tokens go first once the table is full.
    auto* tokens = state_.mutable_tokens();
    for (int i = tokens->size() - 1; i >= 0 && tokens->size() >= kMaxTokens; --i) {
      if (tokens->Get(i).info().expires_unix_s() < now_s) tokens->DeleteSubrange(i, 1);
    }
    if (tokens->size() >= kMaxTokens) {
      return absl::ResourceExhaustedError("10000 live tokens: revoke some first");
    }
    v1::TokenRecord* record = state_.add_tokens();
    v1::TokenInfo* info = record->mutable_info();
    info->set_id(token->id);
    info->set_label(request.label());
    info->set_role(request.role() == v1::TOKEN_ROLE_VIEWER  ? v1::TOKEN_ROLE_VIEWER
                   : request.role() == v1::TOKEN_ROLE_RELAY ? v1::TOKEN_ROLE_RELAY
                                                            : v1::TOKEN_ROLE_WORKER);
    info->set_uses_left(request.uses() == 0 ? -1 : request.uses());
    info->set_created_unix_s(now_s);
    info->set_expires_unix_s(now_s + (request.ttl_s() == 0 ? kDefaultTtlS : request.ttl_s()));
    record->set_secret_sha256(HashTokenSecret(token->secret));
    response.set_token(FormatJoinToken(*token));
    *response.mutable_info() = *info;
    pending = SnapshotLocked();
  }
  if (absl::Status persisted = Write(pending); !persisted.ok()) {
    // Not durable, so not given out: the token is taken back (and the
    // state without it written, in case another change's write had it).
    PendingWrite without;
    {
      absl::MutexLock lock(&mu_);
      auto* tokens = state_.mutable_tokens();
      for (int i = tokens->size() - 1; i >= 0; --i) {
        if (tokens->Get(i).info().id() == token->id) tokens->DeleteSubrange(i, 1);
      }
      without = SnapshotLocked();
    }
    (void)Write(without);  // best effort: the first write just failed
    return persisted;
  }
  return response;
}

v1::ListTokensResponse AccessStore::ListTokens() const {
  absl::ReaderMutexLock lock(&mu_);
  v1::ListTokensResponse response;
  for (const v1::TokenRecord& record : state_.tokens()) *response.add_tokens() = record.info();
  return response;
}

absl::StatusOr<v1::TokenInfo> AccessStore::RevokeToken(const std::string& id_or_token) {
  std::string id = id_or_token;
  if (absl::StatusOr<JoinToken> parsed = ParseJoinToken(id_or_token); parsed.ok()) {
    id = parsed->id;
  }
  v1::TokenInfo revoked;
  PendingWrite pending;
  {
    absl::MutexLock lock(&mu_);
    for (v1::TokenRecord& record : *state_.mutable_tokens()) {
      if (record.info().id() != id) continue;
      record.mutable_info()->set_revoked(true);
      revoked = record.info();
      pending = SnapshotLocked();
      break;
    }
  }
  if (pending.sequence == 0) {
    return absl::NotFoundError(absl::StrCat("no token with id '", id, "'"));
  }
  // Refused from now on even if the write fails (it is retried by the next).
  RETURN_IF_ERROR(Write(pending));
  return revoked;
}

absl::StatusOr<const v1::TokenRecord*> AccessStore::FindValidLocked(const std::string& text,
                                                                   v1::TokenRole role) const {
  absl::StatusOr<JoinToken> token = ParseJoinToken(text);
  if (!token.ok()) return token.status();
  if (token->ca_fingerprint != ca_fingerprint_) {
    return absl::UnauthenticatedError(
        absl::StrCat("token ", token->id, " was made for a coordinator whose CA is ",
                     token->ca_fingerprint, "; this one's is ", ca_fingerprint_));
  }
  for (const v1::TokenRecord& record : state_.tokens()) {
    const v1::TokenInfo& info = record.info();
    if (info.id() != token->id) continue;
    if (!ConstantTimeEquals(record.secret_sha256(), HashTokenSecret(token->secret))) {
      return absl::UnauthenticatedError(absl::StrCat("token ", info.id(), ": wrong secret"));
    }
    if (info.revoked()) {
      return absl::PermissionDeniedError(absl::StrCat("token ", info.id(), " was revoked"));
    }
    if (absl::ToUnixSeconds(now_()) >= info.expires_unix_s()) {
      return absl::PermissionDeniedError(
          absl::StrCat("token ", info.id(), " expired at ",
                       absl::FormatTime(absl::FromUnixSeconds(info.expires_unix_s()),
                                        absl::UTCTimeZone())));
    }
    if (info.uses_left() == 0) {
      return absl::PermissionDeniedError(absl::StrCat("token ", info.id(), " is used up"));
    }
    // A worker token's check also takes a relay token (both enroll an
    // identity; Join tells the two apart).
    if (info.role() != role &&
        !(role == v1::TOKEN_ROLE_WORKER && info.role() == v1::TOKEN_ROLE_RELAY)) {
      return absl::PermissionDeniedError(absl::StrCat("token ", info.id(), " is a ",
                                                      RoleName(info.role()), " token, not a ",
                                                      RoleName(role), " token"));
    }
    return &record;
  }
  return absl::UnauthenticatedError(
      absl::StrCat("token ", token->id, " is not known to this coordinator"));
}

absl::StatusOr<std::string> AccessStore::CheckToken(const std::string& token,
                                                    v1::TokenRole role) const {
  absl::ReaderMutexLock lock(&mu_);
  absl::StatusOr<const v1::TokenRecord*> record = FindValidLocked(token, role);
  if (!record.ok()) return record.status();
  return (*record)->info().id();
}

absl::StatusOr<std::string> AccessStore::RedeemForWorker(
    const std::string& token, const std::function<bool(const std::string&)>& taken,
    std::string* token_id) {
  std::string id;
  PendingWrite pending;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<const v1::TokenRecord*> found = FindValidLocked(token, v1::TOKEN_ROLE_WORKER);
    if (!found.ok()) return found.status();
    v1::TokenRecord* record = const_cast<v1::TokenRecord*>(*found);
    do {
      id = absl::StrCat("w", state_.next_worker_number());
      state_.set_next_worker_number(state_.next_worker_number() + 1);
    } while (taken(id));
    v1::TokenInfo* info = record->mutable_info();
    if (info->uses_left() > 0) info->set_uses_left(info->uses_left() - 1);
    // The list of workers is informative: it stops growing at 1000.
    if (info->workers_size() < 1000) info->add_workers(id);
    *token_id = info->id();
    pending = SnapshotLocked();
  }
  // The id and the use are durable before a certificate names them. A
  // failed write leaves both spent in memory: the enrollment is refused,
  // and neither is given out again.
  RETURN_IF_ERROR(Write(pending));
  return id;
}

absl::Status AccessStore::RevokeWorker(const std::string& worker_id) {
  PendingWrite pending;
  {
    absl::MutexLock lock(&mu_);
    bool known = false;
    for (const std::string& id : state_.revoked_workers()) known = known || id == worker_id;
    if (!known) state_.add_revoked_workers(worker_id);
    {
      absl::MutexLock revoked(&revoked_mu_);
      revoked_.insert(worker_id);
    }
    // Written even when known: another caller's write of it may be under
    // way or may have failed, and OK means durable (Write skips the disk
    // when a later snapshot is on it already).
    pending = SnapshotLocked();
  }
  return Write(pending);
}

bool AccessStore::IsWorkerRevoked(const std::string& worker_id) const {
  absl::MutexLock lock(&revoked_mu_);
  return revoked_.contains(worker_id);
}

std::vector<std::string> AccessStore::RevokedWorkers(size_t max) const {
  absl::ReaderMutexLock lock(&mu_);
  const auto& all = state_.revoked_workers();
  const size_t size = static_cast<size_t>(all.size());
  const size_t first = size > max ? size - max : 0;
  return std::vector<std::string>(all.begin() + first, all.end());
}

bool AccessStore::IssuedWorker(const std::string& worker_id) const {
  int number = 0;
  absl::string_view digits = worker_id;
  if (!absl::ConsumePrefix(&digits, "w") || digits.empty() ||
      !absl::SimpleAtoi(digits, &number) || absl::StrCat("w", number) != worker_id) {
    return false;
  }
  absl::ReaderMutexLock lock(&mu_);
  return number >= 0 && number < state_.next_worker_number();
}

v1::TokenRole AccessStore::RoleOfWorker(const std::string& worker_id) const {
  absl::ReaderMutexLock lock(&mu_);
  for (const v1::TokenRecord& record : state_.tokens()) {
    for (const std::string& id : record.info().workers()) {
      if (id == worker_id) return record.info().role();
    }
  }
  return v1::TOKEN_ROLE_UNSPECIFIED;
}

std::string AccessStore::TokenOfWorker(const std::string& worker_id) const {
  absl::ReaderMutexLock lock(&mu_);
  for (const v1::TokenRecord& record : state_.tokens()) {
    for (const std::string& id : record.info().workers()) {
      if (id == worker_id) return record.info().id();
    }
  }
  return "";
}

}  // namespace geotrain
