#include "common/token_file.h"

#include <gtest/gtest.h>

#include <fstream>
#include <vector>

namespace geotrain {
namespace {

std::string Write(const std::string& name, const std::string& bytes) {
  const std::string path = testing::TempDir() + "/token_file_test_" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string Uint16s(const std::vector<uint16_t>& ids) {
  std::string out;
  for (uint16_t id : ids) {
    out += static_cast<char>(id & 0xff);
    out += static_cast<char>(id >> 8);
  }
  return out;
}

TEST(TokenFileTest, ReadsLittleEndianIdsInPlace) {
  const std::string path = Write("ok.bin", Uint16s({1, 2, 300, 65535}));
  absl::StatusOr<TokenFile> file = TokenFile::Open(path, 2, 65536, 4);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->size(), 4);
  EXPECT_EQ(file->at(2), 300);
  std::vector<int64_t> out(3);
  file->Copy(1, 3, out.data());
  EXPECT_EQ(out, (std::vector<int64_t>{2, 300, 65535}));
  // uint32: the same bytes are two tokens.
  absl::StatusOr<TokenFile> wide = TokenFile::Open(path, 4, int64_t{1} << 32, 1);
  ASSERT_TRUE(wide.ok());
  EXPECT_EQ(wide->size(), 2);
  EXPECT_EQ(wide->at(0), 1 + (2 << 16));
}

TEST(TokenFileTest, BadFilesAreErrorsThatNameThem) {
  const std::string path = Write("bad.bin", Uint16s({1, 2, 50000, 3}));
  absl::StatusOr<TokenFile> file = TokenFile::Open(path, 2, 32000, 1);
  ASSERT_FALSE(file.ok());
  EXPECT_NE(file.status().message().find(path), std::string::npos);
  EXPECT_NE(file.status().message().find("token id 50000 at position 2"), std::string::npos)
      << file.status();
  EXPECT_NE(TokenFile::Open(Write("odd.bin", "abc"), 2, 256, 1).status().message().find(
                "whole number"),
            std::string::npos);
  EXPECT_NE(TokenFile::Open(path, 2, 65536, 100).status().message().find("fewer than"),
            std::string::npos);
  EXPECT_EQ(TokenFile::Open(path + ".missing", 2, 256, 1).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(TokenFile::Open(path, 3, 256, 1).ok());
}

}  // namespace
}  // namespace geotrain
