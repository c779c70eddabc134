#include "common/commitment.h"

#include <openssl/evp.h>

#include <cstdint>
#include <memory>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

// Domain separation: a commitment is never the hash of anything else
// geotrain hashes.
constexpr absl::string_view kDomain = "geotrain.link-commitment.v3";

// Appends fixed-width little-endian integers.
class Layout {
 public:
  void U64(uint64_t value) {
    for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
  void I64(int64_t value) { U64(static_cast<uint64_t>(value)); }
  // Length-prefixed, so no two fields' bytes can be read as each other's.
  void Bytes(absl::string_view value) {
    U64(value.size());
    bytes_.append(value.data(), value.size());
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

std::string IdentityOf(const v1::LinkHeader& header) {
  Layout out;
  out.I64(header.kind());
  out.U64(header.epoch());
  out.U64(header.microbatch());
  out.I64(header.step());
  out.I64(header.weight_version());
  out.I64(header.from_stage());
  out.U64(static_cast<uint64_t>(header.weight_versions_size()));
  for (int64_t version : header.weight_versions()) out.I64(version);
  out.U64(static_cast<uint64_t>(header.tensors_size()));
  for (const v1::TensorHeader& t : header.tensors()) {
    out.U64(static_cast<uint64_t>(t.shape_size()));
    for (int64_t d : t.shape()) out.I64(d);
    out.I64(t.dtype());
    out.I64(t.codec());
    out.U64(t.payload_bytes());
    out.U64(t.block_size());
    out.U64(t.zstd() ? 1 : 0);
    out.U64(t.encoded_bytes());
  }
  out.Bytes(header.weights_digest());
  out.Bytes(header.state_digest());
  out.I64(header.weight_syncs());
  return out.bytes();
}

}  // namespace

bool IsCommittedKind(v1::MessageKind kind) {
  return kind == v1::MESSAGE_KIND_ACTIVATION || kind == v1::MESSAGE_KIND_GRADIENT;
}

std::string CommitmentOf(const v1::LinkHeader& header, absl::string_view payload) {
  const std::string identity = IdentityOf(header);
  Layout lengths;
  lengths.U64(identity.size());
  lengths.U64(payload.size());
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  // Failures here are allocation failures inside OpenSSL; an empty result
  // then matches no commitment and the message is refused, never trusted.
  if (ctx == nullptr || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(ctx.get(), kDomain.data(), kDomain.size()) != 1 ||
      EVP_DigestUpdate(ctx.get(), lengths.bytes().data(), lengths.bytes().size()) != 1 ||
      EVP_DigestUpdate(ctx.get(), identity.data(), identity.size()) != 1 ||
      EVP_DigestUpdate(ctx.get(), payload.data(), payload.size()) != 1 ||
      EVP_DigestFinal_ex(ctx.get(), digest, &size) != 1 || size != kCommitmentBytes) {
    return "";
  }
  return std::string(reinterpret_cast<const char*>(digest), size);
}

absl::Status CheckCommitment(const v1::LinkHeader& header, absl::string_view payload) {
  if (!IsCommittedKind(header.kind())) {
    if (!header.commitment().empty()) {
      return absl::InvalidArgumentError("a commitment on a message of a kind that has none");
    }
    return absl::OkStatus();
  }
  if (header.commitment().size() != kCommitmentBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the message's commitment has ", header.commitment().size(),
                     " bytes; a commitment has ", kCommitmentBytes));
  }
  const std::string expected = CommitmentOf(header, payload);
  if (expected.empty() || expected != header.commitment()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the message's commitment ", CommitmentHex(header.commitment()),
        " is not that of its header and payload (", CommitmentHex(expected), ")"));
  }
  return absl::OkStatus();
}

std::string CommitmentHex(absl::string_view commitment) {
  return absl::BytesToHexString(commitment);
}

}  // namespace geotrain
