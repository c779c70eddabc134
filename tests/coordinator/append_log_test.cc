#include "coordinator/append_log.h"

#include <sys/resource.h>

#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace geotrain {
namespace {

std::string TempPath(const std::string& name) {
  const std::string path = testing::TempDir() + "/append_log_" + name;
  std::filesystem::remove(path);
  return path;
}

std::string Contents(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(AppendLogTest, AppendsInOrderAndContinuesOrTruncates) {
  const std::string path = TempPath("order");
  {
    AppendLogOptions options;
    options.path = path;
    auto log = AppendLog::Open(options);
    ASSERT_TRUE(log.ok()) << log.status();
    (*log)->Append("one");
    (*log)->Append("two");
  }  // the destructor writes what is pending
  EXPECT_EQ(Contents(path), "one\ntwo\n");
  {
    AppendLogOptions options;
    options.path = path;
    auto log = AppendLog::Open(options);
    ASSERT_TRUE(log.ok());
    (*log)->Append("three");
    (*log)->Flush();
    EXPECT_EQ((*log)->written(), 1);
  }
  EXPECT_EQ(Contents(path), "one\ntwo\nthree\n");
  AppendLogOptions options;
  options.path = path;
  options.truncate = true;
  auto log = AppendLog::Open(options);
  ASSERT_TRUE(log.ok());
  (*log)->Flush();
  EXPECT_EQ(Contents(path), "");
}

// Issue 32: one worker wrote 3,000 events in 1.3 s, about 4.4 GB an hour
// of events.log, which was never rotated.
TEST(AppendLogTest, ARotatedLogHoldsAtMostTwiceItsBoundOnDisk) {
  const std::string path = TempPath("rotated");
  std::filesystem::remove(path + ".1");
  AppendLogOptions options;
  options.path = path;
  options.rotate_bytes = 4096;
  auto log = AppendLog::Open(options);
  ASSERT_TRUE(log.ok()) << log.status();
  const std::string line(99, 'x');  // 100 bytes with its newline
  for (int i = 0; i < 1000; ++i) {
    (*log)->Append(line);
    if (i % 10 == 0) (*log)->Flush();
  }
  (*log)->Append("the last line");
  (*log)->Flush();
  EXPECT_EQ((*log)->written(), 1001);
  ASSERT_TRUE(std::filesystem::exists(path + ".1"));
  EXPECT_LE(std::filesystem::file_size(path), 4096u + 1100u);
  EXPECT_LE(std::filesystem::file_size(path + ".1"), 4096u + 1100u);
  // The newest line is on disk: in the current file, or in the rotated one
  // when the batch that held it filled the file (batches follow the
  // writer thread's timing).
  EXPECT_NE((Contents(path) + Contents(path + ".1")).find("the last line"), std::string::npos);
}

TEST(AppendLogTest, AppendsNeverWaitForAStuckDiskAndTheQueueIsBounded) {
  absl::Notification disk_free;
  std::atomic<int> stuck{0};
  AppendLogOptions options;
  options.path = TempPath("stuck");
  options.max_pending_lines = 100;
  options.before_write = [&] {
    ++stuck;
    disk_free.WaitForNotification();
    return absl::OkStatus();
  };
  auto log = AppendLog::Open(options);
  ASSERT_TRUE(log.ok());
  (*log)->Append("first");
  while (stuck == 0) absl::SleepFor(absl::Milliseconds(1));
  // The first batch is stuck in "the disk"; these return at once, and past
  // 100 pending lines the oldest are dropped.
  const absl::Time start = absl::Now();
  for (int i = 0; i < 1000; ++i) (*log)->Append("line " + std::to_string(i));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  disk_free.Notify();
  (*log)->Flush();
  EXPECT_EQ((*log)->written(), 101);
  EXPECT_EQ((*log)->dropped(), 900);
  const std::string contents = Contents(options.path);
  EXPECT_EQ(contents.find("line 899\n"), std::string::npos);
  EXPECT_NE(contents.find("first\nline 900\n"), std::string::npos);
  EXPECT_NE(contents.find("line 999\n"), std::string::npos);
}

TEST(AppendLogTest, AFailedWriteLosesItsBatchOnlyAndAnUnwritablePathIsAnError) {
  std::atomic<bool> fail{true};
  AppendLogOptions options;
  options.path = TempPath("fail");
  options.before_write = [&] {
    return fail ? absl::UnavailableError("disk full (injected)") : absl::OkStatus();
  };
  auto log = AppendLog::Open(options);
  ASSERT_TRUE(log.ok());
  (*log)->Append("lost");
  (*log)->Flush();
  fail = false;
  (*log)->Append("kept");
  (*log)->Flush();
  EXPECT_EQ((*log)->dropped(), 1);
  EXPECT_EQ(Contents(options.path), "kept\n");

  AppendLogOptions bad;
  bad.path = testing::TempDir() + "/no/such/dir/log";
  auto refused = AppendLog::Open(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("no/such/dir"), std::string::npos);
}

TEST(AppendLogTest, AQueueOfNoLinesStillKeepsTheNewest) {
  AppendLogOptions options;
  options.path = TempPath("zero");
  options.max_pending_lines = 0;
  auto log = AppendLog::Open(options);
  ASSERT_TRUE(log.ok());
  (*log)->Append("kept");
  (*log)->Flush();  // returns: the line was written, not lost unseen
  EXPECT_EQ(Contents(options.path), "kept\n");
}

// Appends `data` while the process may write files of at most `limit`
// bytes: the kernel writes part of the batch, then refuses (EFBIG), as a
// full disk would.
void AppendUnderFileSizeLimit(AppendLog* log, const std::string& data, rlim_t limit) {
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit limited = saved;
  limited.rlim_cur = limit;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limited), 0);
  log->Append(data);
  log->Flush();
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &saved), 0);
}

TEST(AppendLogTest, ALineTornByAFullDiskDoesNotSwallowTheNextOne) {
  // A file size limit makes the kernel write part of a batch, then refuse
  // (EFBIG), as a full disk would.
  const std::string path = TempPath("torn");
  AppendLogOptions options;
  options.path = path;
  auto log = AppendLog::Open(options);
  ASSERT_TRUE(log.ok());
  (*log)->Append("first");
  (*log)->Flush();
  AppendUnderFileSizeLimit(log->get(), "second line", 10);  // "first\n" and 4 bytes more
  EXPECT_EQ((*log)->dropped(), 1);
  (*log)->Append("third");
  (*log)->Flush();
  EXPECT_EQ(Contents(path), "first\nseco\nthird\n");
}

TEST(AppendLogTest, ARecordTornByAFullDiskIsCutOff) {
  // Binary records have no line to end: a torn one is cut off the file, so
  // the next record follows the last whole one.
  const std::string path = TempPath("torn-binary");
  AppendLogOptions options;
  options.path = path;
  options.binary_records = true;
  auto log = AppendLog::Open(options);
  ASSERT_TRUE(log.ok());
  (*log)->Append("first");
  (*log)->Flush();
  AppendUnderFileSizeLimit(log->get(), "second", 9);  // "first" and 4 bytes more
  EXPECT_EQ((*log)->dropped(), 1);
  (*log)->Append("third");
  (*log)->Flush();
  EXPECT_EQ(Contents(path), "firstthird");
}

}  // namespace
}  // namespace geotrain
