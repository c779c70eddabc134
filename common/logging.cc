#include "common/logging.h"

#include <sys/time.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <mutex>

namespace geotrain {
namespace {
std::mutex& PrefixMutex() {
  static std::mutex mu;
  return mu;
}
std::string& Prefix() {
  static std::string prefix;
  return prefix;
}
}  // namespace

void SetLogPrefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(PrefixMutex());
  Prefix() = prefix;
}

void WriteLogLine(LogSeverity severity, const std::string& message) {
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm local;
  localtime_r(&tv.tv_sec, &local);
  const char level = severity == LogSeverity::kInfo      ? 'I'
                     : severity == LogSeverity::kWarning ? 'W'
                                                         : 'E';
  std::string prefix;
  {
    std::lock_guard<std::mutex> lock(PrefixMutex());
    prefix = Prefix();
  }
  char head[64];
  std::snprintf(head, sizeof(head), "%c%02d%02d %02d:%02d:%02d.%03d ", level,
                local.tm_mon + 1, local.tm_mday, local.tm_hour, local.tm_min,
                local.tm_sec, static_cast<int>(tv.tv_usec / 1000));
  std::string line = head + prefix + "] " + message + "\n";
  (void)!write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace geotrain
