#include "common/tf_record.h"

#include <array>

namespace geotrain {
namespace {

constexpr uint32_t kCastagnoliReflected = 0x82f63b78;
constexpr uint32_t kMaskDelta = 0xa282ead8;

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? kCastagnoliReflected : 0);
    table[byte] = crc;
  }
  return table;
}

void AppendLittleEndian(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

}  // namespace

uint32_t Crc32c(absl::string_view data) {
  static const std::array<uint32_t, 256> kTable = MakeTable();
  uint32_t crc = 0xffffffff;
  for (unsigned char c : data) crc = (crc >> 8) ^ kTable[(crc ^ c) & 0xff];
  return crc ^ 0xffffffff;
}

uint32_t MaskedCrc32c(absl::string_view data) {
  const uint32_t crc = Crc32c(data);
  return ((crc >> 15) | (crc << 17)) + kMaskDelta;
}

std::string TfRecord(absl::string_view data) {
  std::string record;
  record.reserve(data.size() + 16);
  AppendLittleEndian(&record, data.size(), 8);
  AppendLittleEndian(&record, MaskedCrc32c(record), 4);
  record.append(data.data(), data.size());
  AppendLittleEndian(&record, MaskedCrc32c(data), 4);
  return record;
}

}  // namespace geotrain
