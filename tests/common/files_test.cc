#include "common/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "common/json.h"

namespace geotrain {
namespace {

TEST(JsonTest, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(JsonEscape("a\"b\\c\nd\x01"), "a\\\"b\\\\c\\u000ad\\u0001");
  EXPECT_EQ(JsonString("caf\xc3\xa9"), "\"caf\xc3\xa9\"");  // UTF-8 kept
  EXPECT_EQ(JsonString(""), "\"\"");
}

TEST(JsonTest, WholeNumberTakesOnlyWholeNumbersInRange) {
  auto number = [](double d) {
    google::protobuf::Value v;
    v.set_number_value(d);
    return v;
  };
  uint64_t out = 7;
  EXPECT_TRUE(WholeNumber(number(0), 10, &out));
  EXPECT_EQ(out, 0u);
  EXPECT_TRUE(WholeNumber(number(10), 10, &out));
  EXPECT_EQ(out, 10u);
  EXPECT_TRUE(WholeNumber(number(9007199254740992.0), UINT64_MAX, &out));  // 2^53
  EXPECT_EQ(out, uint64_t{1} << 53);
  out = 7;
  for (double bad : {11.0, -1.0, 0.5, std::nan(""), 1e300}) {
    EXPECT_FALSE(WholeNumber(number(bad), 10, &out)) << bad;
  }
  EXPECT_FALSE(WholeNumber(number(18014398509481984.0), UINT64_MAX, &out));  // 2^54
  google::protobuf::Value text;
  text.set_string_value("3");
  EXPECT_FALSE(WholeNumber(text, 10, &out));
  EXPECT_EQ(out, 7u);  // untouched by every refusal
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
