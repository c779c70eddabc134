#include "common/spot_check_draw.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

constexpr char kDomain[] = "geotrain.spot-check.v1";

void AppendU64(uint64_t value, std::string* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

}  // namespace

absl::StatusOr<SpotCheckDraw> SpotCheckDraw::Create(std::string key, double fraction) {
  if (key.size() != kSpotCheckKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a spot-check key has ", kSpotCheckKeyBytes,
                                                   " bytes, not ", key.size()));
  }
  if (!(fraction >= 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the spot-check fraction must be in [0, 1], not ", fraction));
  }
  return SpotCheckDraw(std::move(key), fraction);
}

absl::StatusOr<std::string> SpotCheckDraw::NewKey() {
  std::string key(kSpotCheckKeyBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(key.data()), static_cast<int>(key.size())) !=
      1) {
    return absl::InternalError("no random bytes for a spot-check key (RAND_bytes failed)");
  }
  return key;
}

double SpotCheckDraw::Draw(uint64_t epoch, uint64_t microbatch, int stage) const {
  std::string message(kDomain);
  AppendU64(epoch, &message);
  AppendU64(microbatch, &message);
  AppendU64(static_cast<uint64_t>(stage), &message);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_bytes = 0;
  HMAC(EVP_sha256(), key_.data(), static_cast<int>(key_.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &mac_bytes);
  uint64_t head = 0;
  for (int i = 0; i < 8; ++i) head = (head << 8) | mac[i];
  // The top 53 bits, so the double is exact and below 1.
  return static_cast<double>(head >> 11) * 0x1.0p-53;
}

bool SpotCheckDraw::Chosen(uint64_t epoch, uint64_t microbatch, int stage) const {
  return Draw(epoch, microbatch, stage) < fraction_;
}

}  // namespace geotrain
