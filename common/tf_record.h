// TFRecord framing, the container of TensorBoard's event files: each record
// is its length (uint64, little-endian), the masked CRC-32C of those 8
// bytes, the data, and the masked CRC-32C of the data (both uint32,
// little-endian). Masking rotates the CRC right by 15 bits and adds
// 0xa282ead8, so that a CRC of data that holds CRCs stays well mixed.
#ifndef GEOTRAIN_COMMON_TF_RECORD_H_
#define GEOTRAIN_COMMON_TF_RECORD_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace geotrain {

// CRC-32C (Castagnoli, reflected polynomial 0x82f63b78), as iSCSI and
// TFRecord use it: Crc32c("123456789") == 0xe3069283.
uint32_t Crc32c(absl::string_view data);
uint32_t MaskedCrc32c(absl::string_view data);

// `data` framed as one record.
std::string TfRecord(absl::string_view data);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_TF_RECORD_H_
