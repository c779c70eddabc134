#include "coordinator/append_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

AppendLog::AppendLog(AppendLogOptions options, int fd)
    : options_(std::move(options)), fd_(fd), thread_([this] { Run(); }) {}

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
  line += '\n';
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

void AppendLog::Run() {
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
    std::string data;
    for (const std::string& line : batch) data += line;
    absl::Status status = options_.before_write ? options_.before_write() : absl::OkStatus();
    for (size_t off = 0; status.ok() && off < data.size();) {
      const ssize_t n = write(fd_, data.data() + off, data.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        status = absl::UnavailableError(std::strerror(errno));
        break;
      }
      off += static_cast<size_t>(n);
    }
    if (!status.ok()) {
      GT_LOG(Warning) << "could not append " << batch.size() << " lines to " << options_.path
                      << ": " << status.message();
    }
    absl::MutexLock lock(&mu_);
    (status.ok() ? written_ : dropped_) += static_cast<int64_t>(batch.size());
    done_ = sequence;
    changed_.SignalAll();
  }
}

std::string JsonEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace geotrain
