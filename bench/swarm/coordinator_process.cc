#include "bench/swarm/coordinator_process.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace geotrain::swarm {

namespace {

// The whole of a /proc file through a descriptor opened once (pread from 0
// reads it afresh); "" when it cannot be read.
std::string ReadAll(int fd) {
  std::string text;
  char buffer[4096];
  for (off_t at = 0;;) {
    const ssize_t n = pread(fd, buffer, sizeof(buffer), at);
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
    at += n;
  }
  return text;
}

}  // namespace

ProcStat ParseProc(const std::string& stat_text, const std::string& status_text) {
  ProcStat out;
  // Fields after the ")" of the command: utime is the 14th, stime the 15th.
  const size_t close = stat_text.rfind(')');
  if (close != std::string::npos && close + 2 < stat_text.size()) {
    std::vector<std::string> fields = absl::StrSplit(stat_text.substr(close + 2), ' ');
    if (fields.size() > 13) {
      double utime = 0, stime = 0;
      (void)absl::SimpleAtod(fields[11], &utime);
      (void)absl::SimpleAtod(fields[12], &stime);
      out.cpu_s = (utime + stime) / sysconf(_SC_CLK_TCK);
    }
  }
  for (absl::string_view line : absl::StrSplit(status_text, '\n')) {
    double value = 0;
    if (absl::ConsumePrefix(&line, "VmRSS:") &&
        absl::SimpleAtod(absl::StripSuffix(absl::StripAsciiWhitespace(line), " kB"), &value)) {
      out.rss_mib = value / 1024;
    }
    int threads = 0;
    if (absl::ConsumePrefix(&line, "Threads:") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &threads)) {
      out.threads = threads;
    }
  }
  return out;
}

ProcStat CoordinatorProcess::Stat() const {
  if (stat_fd_ < 0 || status_fd_ < 0) return ProcStat();
  return ParseProc(ReadAll(stat_fd_), ReadAll(status_fd_));
}

void CoordinatorProcess::CloseProc() {
  if (stat_fd_ >= 0) close(stat_fd_);
  if (status_fd_ >= 0) close(status_fd_);
  stat_fd_ = status_fd_ = -1;
}

CoordinatorProcess::CoordinatorProcess(std::string binary, std::string dir,
                                       std::vector<std::string> flags)
    : binary_(std::move(binary)), dir_(std::move(dir)), flags_(std::move(flags)) {}

CoordinatorProcess::~CoordinatorProcess() {
  if (pid_ > 0) Kill();
}

absl::Status CoordinatorProcess::Start() {
  const std::string port_file = dir_ + "/port";
  unlink(port_file.c_str());
  std::vector<std::string> args = {binary_, "--state_dir=" + state_dir(),
                                   "--port_file=" + port_file};
  args.push_back(address_.empty() ? "--listen=127.0.0.1:0" : "--listen=" + address_);
  args.insert(args.end(), flags_.begin(), flags_.end());
  // Everything the child needs is made before fork(): this process has
  // threads, and the child may only make async-signal-safe calls.
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const std::string log = dir_ + "/coordinator.log";
  const int log_fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return absl::UnavailableError(absl::StrCat("cannot open ", log));
  std::fflush(stdout);  // the child must not repeat what is buffered
  std::fflush(stderr);
  pid_ = fork();
  if (pid_ == 0) {
    if (dup2(log_fd, STDOUT_FILENO) < 0 || dup2(log_fd, STDERR_FILENO) < 0) _exit(126);
    execv(binary_.c_str(), argv.data());
    _exit(127);
  }
  close(log_fd);
  std::string port;
  for (int i = 0; i < 600 && port.empty(); ++i) {
    std::ifstream in(port_file);
    std::getline(in, port);
    if (port.empty()) {
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        break;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  if (port.empty()) {
    if (pid_ > 0) Kill();
    return absl::UnavailableError(
        absl::StrCat("the coordinator did not start (see ", dir_, "/coordinator.log)"));
  }
  address_ = "127.0.0.1:" + port;
  // Opened now, while this process has descriptors to spare: ten thousand
  // workers' channels took all of them, and /proc could not be read later.
  CloseProc();
  const std::string proc = absl::StrCat("/proc/", pid_);
  stat_fd_ = open((proc + "/stat").c_str(), O_RDONLY | O_CLOEXEC);
  status_fd_ = open((proc + "/status").c_str(), O_RDONLY | O_CLOEXEC);
  return absl::OkStatus();
}

void CoordinatorProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
  CloseProc();
}

void CoordinatorProcess::Terminate() {
  if (pid_ <= 0) return;
  kill(pid_, SIGTERM);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
  CloseProc();
}

}  // namespace geotrain::swarm
