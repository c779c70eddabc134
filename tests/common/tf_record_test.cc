#include "common/tf_record.h"

#include <string>

#include "gtest/gtest.h"

namespace geotrain {
namespace {

TEST(Crc32cTest, KnownValues) {
  // The check value of CRC-32C, and RFC 3720's test vectors (B.4).
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8a9136aau);
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62a8ab43u);
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(Crc32cTest, MaskRotatesAndAddsTheDelta) {
  const uint32_t crc = Crc32c("123456789");
  EXPECT_EQ(MaskedCrc32c("123456789"), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

uint64_t ReadLittleEndian(const std::string& bytes, size_t at, int width) {
  uint64_t value = 0;
  for (int i = width - 1; i >= 0; --i) {
    value = (value << 8) | static_cast<unsigned char>(bytes[at + i]);
  }
  return value;
}

TEST(TfRecordTest, FramesLengthDataAndBothCrcs) {
  const std::string data = "an event";
  const std::string record = TfRecord(data);
  ASSERT_EQ(record.size(), 8 + 4 + data.size() + 4);
  EXPECT_EQ(ReadLittleEndian(record, 0, 8), data.size());
  EXPECT_EQ(ReadLittleEndian(record, 8, 4), MaskedCrc32c(record.substr(0, 8)));
  EXPECT_EQ(record.substr(12, data.size()), data);
  EXPECT_EQ(ReadLittleEndian(record, 12 + data.size(), 4), MaskedCrc32c(data));
}

}  // namespace
}  // namespace geotrain
