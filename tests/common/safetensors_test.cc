#include "common/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

namespace geotrain {
namespace {

std::string LittleEndian64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

// A file with `json` as its header and `data_bytes` zero bytes of data.
std::string FileOf(const std::string& json, size_t data_bytes) {
  return LittleEndian64(json.size()) + json + std::string(data_bytes, '\0');
}

std::string ErrorOf(const std::string& file) {
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensorsHeader(file, file.size(), "m.safetensors");
  EXPECT_FALSE(header.ok());
  if (header.ok()) return "";
  EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(header.status().message());
  EXPECT_NE(message.find("m.safetensors"), std::string::npos) << message;  // names the file
  return message;
}

TEST(SafetensorsTest, WritesAndReadsBackInPlace) {
  const std::string path = testing::TempDir() + "/safetensors_test.safetensors";
  const float weights[6] = {1, 2, 3, 4, 5, 6};
  const uint16_t half[3] = {0x3c00, 0x4000, 0x4200};
  std::vector<SafetensorsBlob> blobs = {
      {"model.embed_tokens.weight", "F32", {2, 3},
       std::string_view(reinterpret_cast<const char*>(weights), sizeof(weights))},
      {"lm_head.weight", "BF16", {3},
       std::string_view(reinterpret_cast<const char*>(half), sizeof(half))},
  };
  ASSERT_TRUE(WriteSafetensors(path, blobs, {{"format", "pt"}}).ok());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  absl::StatusOr<SafetensorsReader> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->header().data_start % 8, 0u);  // padded as the format's writer does
  EXPECT_EQ(reader->header().metadata.at("format"), "pt");
  ASSERT_EQ(reader->header().tensors.size(), 2u);
  const SafetensorsTensor* embed = reader->Find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->shape, (std::vector<int64_t>{2, 3}));
  std::string_view data = reader->Data(*embed);
  ASSERT_EQ(data.size(), sizeof(weights));
  EXPECT_EQ(std::memcmp(data.data(), weights, sizeof(weights)), 0);
  EXPECT_EQ(reader->Data(*reader->Find("lm_head.weight")).size(), 6u);
  EXPECT_EQ(reader->Find("missing"), nullptr);
}

TEST(SafetensorsTest, MalformedFilesAreRefusedWithTheReason) {
  // Header length past the file, and past the limit.
  EXPECT_NE(ErrorOf(LittleEndian64(1000) + "{}").find("runs past"), std::string::npos);
  EXPECT_NE(ErrorOf(LittleEndian64(1ull << 40) + "{}").find("limit"), std::string::npos);
  EXPECT_NE(ErrorOf("abc").find("shorter"), std::string::npos);
  EXPECT_NE(ErrorOf(FileOf("[1, 2]", 0)).find("JSON object"), std::string::npos);
  EXPECT_NE(ErrorOf(FileOf("{\"a\": {\"dtype\": \"F33\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4))
                .find("unknown dtype"),
            std::string::npos);
  // 2 x 3 floats are 24 bytes, not 20.
  EXPECT_NE(ErrorOf(FileOf("{\"a\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 20]}}", 20))
                .find("20 bytes for its shape"),
            std::string::npos);
  // Truncated: the data section is 8 bytes, the tensor ends at 24.
  EXPECT_NE(ErrorOf(FileOf("{\"a\": {\"dtype\": \"F32\", \"shape\": [6], \"data_offsets\": [0, 24]}}", 8))
                .find("truncated"),
            std::string::npos);
  EXPECT_NE(ErrorOf(FileOf("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
                           " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [2, 6]}}",
                           8))
                .find("overlap"),
            std::string::npos);
  EXPECT_NE(ErrorOf(FileOf("{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4))
                .find("bad dimension"),
            std::string::npos);
  EXPECT_NE(ErrorOf(FileOf("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 0]}}", 4))
                .find("data_offsets"),
            std::string::npos);
  EXPECT_NE(ErrorOf(FileOf("{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4)).find("lacks"),
            std::string::npos);
  EXPECT_NE(ErrorOf(FileOf("{\"__metadata__\": {\"k\": 1}}", 0)).find("__metadata__"),
            std::string::npos);
  // A product of dimensions that would overflow 64 bits.
  EXPECT_FALSE(ErrorOf(FileOf("{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296, 16],"
                              " \"data_offsets\": [0, 0]}}",
                              0))
                   .empty());
  // Not a file at all.
  EXPECT_EQ(SafetensorsReader::Open(testing::TempDir() + "/no-such.safetensors").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, TheWriterRefusesWhatItCouldNotReadBack) {
  const float one = 1;
  const std::string_view bytes(reinterpret_cast<const char*>(&one), 4);
  EXPECT_FALSE(EncodeSafetensorsHeader({{"a", "F32", {2}, bytes}}, {}).ok());  // 4 bytes for 2
  EXPECT_FALSE(EncodeSafetensorsHeader({{"a", "X", {1}, bytes}}, {}).ok());
  EXPECT_FALSE(EncodeSafetensorsHeader({{"a", "F32", {1}, bytes}, {"a", "F32", {1}, bytes}}, {}).ok());
  EXPECT_FALSE(EncodeSafetensorsHeader({{"", "F32", {1}, bytes}}, {}).ok());
  // Names and metadata with quotes and control characters survive.
  absl::StatusOr<std::string> header =
      EncodeSafetensorsHeader({{"a\"b\n", "F32", {1}, bytes}}, {{"k\"", "v\\"}});
  ASSERT_TRUE(header.ok());
  const std::string file = *header + std::string(bytes);
  absl::StatusOr<SafetensorsHeader> parsed = ParseSafetensorsHeader(file, file.size(), "x");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->tensors[0].name, "a\"b\n");
  EXPECT_EQ(parsed->metadata.at("k\""), "v\\");
}

}  // namespace
}  // namespace geotrain
