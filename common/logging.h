// Minimal line logging to stderr: "I1130 13:45:01.123 prefix] message".
// Thread-safe: each line is written with one call.
#ifndef GEOTRAIN_COMMON_LOGGING_H_
#define GEOTRAIN_COMMON_LOGGING_H_

#include <sstream>
#include <string>

namespace geotrain {

enum class LogSeverity { kInfo, kWarning, kError };

// Sets the tag printed on every line (e.g. the worker's name).
void SetLogPrefix(const std::string& prefix);
void WriteLogLine(LogSeverity severity, const std::string& message);

class LogMessage {
 public:
  explicit LogMessage(LogSeverity severity) : severity_(severity) {}
  ~LogMessage() { WriteLogLine(severity_, stream_.str()); }
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};

}  // namespace geotrain

#define GT_LOG(severity) \
  ::geotrain::LogMessage(::geotrain::LogSeverity::k##severity).stream()

#endif  // GEOTRAIN_COMMON_LOGGING_H_
