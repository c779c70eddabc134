#include "coordinator/tensorboard_writer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/tf_record.h"
#include "geotrain/tensorboard/event.pb.h"

namespace geotrain {
namespace {

uint64_t LittleEndian(const std::string& bytes, size_t at, int width) {
  uint64_t value = 0;
  for (int i = width - 1; i >= 0; --i) {
    value = (value << 8) | static_cast<unsigned char>(bytes[at + i]);
  }
  return value;
}

// The events of a file, each record's CRCs checked.
std::vector<tensorboard::Event> ReadEvents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  const std::string bytes = s.str();
  std::vector<tensorboard::Event> events;
  size_t at = 0;
  while (at < bytes.size()) {
    EXPECT_LE(at + 12, bytes.size());
    const uint64_t length = LittleEndian(bytes, at, 8);
    EXPECT_EQ(LittleEndian(bytes, at + 8, 4), MaskedCrc32c(bytes.substr(at, 8)));
    EXPECT_LE(at + 16 + length, bytes.size());
    const std::string data = bytes.substr(at + 12, length);
    EXPECT_EQ(LittleEndian(bytes, at + 12 + length, 4), MaskedCrc32c(data));
    EXPECT_TRUE(events.emplace_back().ParseFromString(data));
    at += 16 + length;
  }
  return events;
}

TEST(TensorBoardWriterTest, WritesAVersionRecordThenOneEventPerCall) {
  const std::string dir = testing::TempDir() + "/tensorboard_writer_test";
  std::filesystem::remove_all(dir);
  auto writer = TensorBoardWriter::Open(dir + "/run");  // made if missing
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_NE((*writer)->path().find("/run/events.out.tfevents."), std::string::npos);
  const absl::Time when = absl::FromUnixSeconds(1700000000);
  (*writer)->Write(1, when, {{"train/loss", 2.5}, {"train/learning_rate", 3e-4}});
  (*writer)->Write(2, when + absl::Seconds(1), {{"train/loss", 2.25}, {"bad", NAN}});
  (*writer)->Write(3, when, {{"only/bad", INFINITY}});  // nothing to draw: no event
  (*writer)->Flush();
  const std::vector<tensorboard::Event> events = ReadEvents((*writer)->path());
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  EXPECT_EQ(events[1].step(), 1);
  EXPECT_DOUBLE_EQ(events[1].wall_time(), 1700000000.0);
  ASSERT_EQ(events[1].summary().value_size(), 2);
  EXPECT_EQ(events[1].summary().value(0).tag(), "train/loss");
  EXPECT_FLOAT_EQ(events[1].summary().value(0).simple_value(), 2.5f);
  EXPECT_FLOAT_EQ(events[1].summary().value(1).simple_value(), 3e-4f);
  EXPECT_EQ(events[2].step(), 2);
  ASSERT_EQ(events[2].summary().value_size(), 1);  // the NaN is left out
  EXPECT_FLOAT_EQ(events[2].summary().value(0).simple_value(), 2.25f);
}

TEST(TensorBoardWriterTest, ADirectoryThatCannotBeMadeIsAClearError) {
  const std::string file = testing::TempDir() + "/tensorboard_writer_test_file";
  std::ofstream(file) << "a file, not a directory";
  auto writer = TensorBoardWriter::Open(file + "/run");
  ASSERT_FALSE(writer.ok());
  EXPECT_EQ(writer.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(writer.status().message().find("TensorBoard directory"), std::string::npos);
}

}  // namespace
}  // namespace geotrain
