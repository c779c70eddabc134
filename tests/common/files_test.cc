#include "common/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <string>

#include "common/json.h"

namespace geotrain {
namespace {

TEST(JsonTest, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(JsonEscape("a\"b\\c\nd\x01"), "a\\\"b\\\\c\\u000ad\\u0001");
  EXPECT_EQ(JsonString("caf\xc3\xa9"), "\"caf\xc3\xa9\"");  // UTF-8 kept
  EXPECT_EQ(JsonString(""), "\"\"");
}

TEST(FilesTest, WriteAllWritesEverythingOrSaysWhy) {
  const std::string path = testing::TempDir() + "/write_all";
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  const std::string big(3 << 20, 'x');
  ASSERT_TRUE(WriteAll(fd, big, path).ok());
  close(fd);
  absl::StatusOr<std::string> back = ReadFileBounded(path, 4 << 20);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, big);

  const int read_only = open(path.c_str(), O_RDONLY);
  ASSERT_GE(read_only, 0);
  const absl::Status refused = WriteAll(read_only, "y", path);
  close(read_only);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find(path), std::string::npos) << refused;
}

}  // namespace
}  // namespace geotrain
