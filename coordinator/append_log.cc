#include "coordinator/append_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/logging.h"

namespace geotrain {

absl::StatusOr<std::unique_ptr<AppendLog>> AppendLog::Open(AppendLogOptions options) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (options.truncate ? O_TRUNC : O_APPEND);
  const int fd = open(options.path.c_str(), flags, 0644);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot write ", options.path, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<AppendLog>(new AppendLog(std::move(options), fd));
}

namespace {

AppendLogOptions Sane(AppendLogOptions options) {
  // At least the line just appended stays queued (0 would drop every line
  // before the writer saw it).
  options.max_pending_lines = std::max<size_t>(options.max_pending_lines, 1);
  return options;
}

}  // namespace

AppendLog::AppendLog(AppendLogOptions options, int fd)
    : options_(Sane(std::move(options))), fd_(fd), thread_([this] { Run(); }) {}

AppendLog::~AppendLog() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
  }
  thread_.join();
  close(fd_);
}

void AppendLog::Append(std::string line) {
  if (!options_.binary_records) line += '\n';
  absl::MutexLock lock(&mu_);
  pending_.push_back(std::move(line));
  ++appended_;
  while (pending_.size() > options_.max_pending_lines) {
    pending_.pop_front();
    ++dropped_;
  }
  changed_.SignalAll();
}

void AppendLog::Flush() {
  absl::MutexLock lock(&mu_);
  const int64_t target = appended_;
  while (done_ < target) changed_.Wait(&mu_);
}

int64_t AppendLog::written() const {
  absl::MutexLock lock(&mu_);
  return written_;
}

int64_t AppendLog::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

void AppendLog::Rotate() {
  const std::string older = options_.path + ".1";
  if (rename(options_.path.c_str(), older.c_str()) != 0) {
    GT_LOG(Warning) << "could not rotate " << options_.path << ": " << std::strerror(errno);
    return;
  }
  const int fd = open(options_.path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_APPEND, 0644);
  if (fd < 0) {
    GT_LOG(Warning) << "could not reopen " << options_.path << " after rotating it: "
                    << std::strerror(errno);
    return;  // the lines go on to the renamed file
  }
  close(fd_);
  fd_ = fd;
}

void AppendLog::Run() {
  bool torn_line = false;
  while (true) {
    std::deque<std::string> batch;
    int64_t sequence;
    {
      absl::MutexLock lock(&mu_);
      while (pending_.empty() && !stopping_) changed_.Wait(&mu_);
      if (pending_.empty()) return;  // stopping, nothing left
      batch.swap(pending_);
      sequence = appended_;
    }
    // A batch that failed part-way left a torn last line: the next one
    // starts on a line of its own, so that every later line parses.
    std::string data = torn_line ? "\n" : "";
    for (const std::string& line : batch) data += line;
    absl::Status status = options_.before_write ? options_.before_write() : absl::OkStatus();
    if (status.ok()) {
      const off_t before = lseek(fd_, 0, SEEK_END);
      status = WriteAll(fd_, data, options_.path);
      torn_line = !status.ok() && before >= 0 && lseek(fd_, 0, SEEK_END) > before;
      if (torn_line && options_.binary_records) {
        if (ftruncate(fd_, before) != 0) {
          GT_LOG(Warning) << options_.path << ": could not cut off a torn record: "
                          << std::strerror(errno);
        }
        torn_line = false;
      }
    }
    if (!status.ok()) {
      GT_LOG(Warning) << "could not append " << batch.size() << " lines to " << options_.path
                      << ": " << status.message();
    }
    if (status.ok() && options_.rotate_bytes > 0 && !options_.binary_records &&
        static_cast<uint64_t>(lseek(fd_, 0, SEEK_END)) >= options_.rotate_bytes) {
      Rotate();
    }
    absl::MutexLock lock(&mu_);
    (status.ok() ? written_ : dropped_) += static_cast<int64_t>(batch.size());
    done_ = sequence;
    changed_.SignalAll();
  }
}

}  // namespace geotrain
