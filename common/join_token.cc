#include "common/join_token.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <cstdlib>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"

namespace geotrain {
namespace {

constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz0123456789";
constexpr absl::string_view kPrefix = "gt1";

bool AllOf(absl::string_view s, bool (*allowed)(char)) {
  for (char c : s) {
    if (!allowed(c)) return false;
  }
  return true;
}
bool IsLowerAlnum(char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); }
bool IsLowerHex(char c) { return (c >= 'a' && c <= 'f') || (c >= '0' && c <= '9'); }

absl::StatusOr<std::string> RandomString(size_t length) {
  std::vector<unsigned char> bytes(length);
  if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) {
    return absl::InternalError("no randomness from OpenSSL");
  }
  std::string out;
  // 252 = 7 * 36: rejection keeps every character equally likely.
  for (size_t i = 0; out.size() < length;) {
    if (i == bytes.size()) {
      if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) {
        return absl::InternalError("no randomness from OpenSSL");
      }
      i = 0;
    }
    const unsigned char b = bytes[i++];
    if (b < 252) out += kAlphabet[b % 36];
  }
  return out;
}

}  // namespace

std::string RandomHexSecret(size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  if (RAND_bytes(raw.data(), static_cast<int>(raw.size())) != 1) {
    GT_LOG(Error) << "no randomness from OpenSSL";
    std::abort();  // a predictable secret is worse than none
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : raw) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

absl::StatusOr<JoinToken> ParseJoinToken(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  if (text.size() > 256) return absl::InvalidArgumentError("token longer than 256 characters");
  std::vector<absl::string_view> parts = absl::StrSplit(text, '.');
  if (parts.size() != 4 || parts[0] != kPrefix) {
    return absl::InvalidArgumentError(
        "not a geotrain join token (expected gt1.<id>.<secret>.<CA fingerprint>, as printed "
        "by `geotrain-ctl token create`)");
  }
  if (parts[1].size() != kTokenIdLength || !AllOf(parts[1], IsLowerAlnum)) {
    return absl::InvalidArgumentError("the token's id is not 6 characters of [a-z0-9]");
  }
  if (parts[2].size() != kTokenSecretLength || !AllOf(parts[2], IsLowerAlnum)) {
    return absl::InvalidArgumentError("the token's secret is not 32 characters of [a-z0-9]");
  }
  if (parts[3].size() != 64 || !AllOf(parts[3], IsLowerHex)) {
    return absl::InvalidArgumentError(
        "the token's CA fingerprint is not 64 lowercase hex digits");
  }
  return JoinToken{std::string(parts[1]), std::string(parts[2]),
                   absl::StrCat("sha256:", parts[3])};
}

std::string FormatJoinToken(const JoinToken& token) {
  absl::string_view fingerprint = token.ca_fingerprint;
  absl::ConsumePrefix(&fingerprint, "sha256:");
  return absl::StrCat(kPrefix, ".", token.id, ".", token.secret, ".", fingerprint);
}

absl::StatusOr<JoinToken> NewJoinToken(const std::string& ca_fingerprint) {
  absl::StatusOr<std::string> id = RandomString(kTokenIdLength);
  if (!id.ok()) return id.status();
  absl::StatusOr<std::string> secret = RandomString(kTokenSecretLength);
  if (!secret.ok()) return secret.status();
  return JoinToken{*std::move(id), *std::move(secret), ca_fingerprint};
}

std::string HashTokenSecret(absl::string_view secret) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(secret.data()), secret.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace geotrain
