// The real geotrain-coordinator the swarm runs against: its own process on
// loopback, started, killed (-9) and started again on the same state
// directory, with its CPU, RSS and threads read from /proc.
#ifndef GEOTRAIN_BENCH_SWARM_COORDINATOR_PROCESS_H_
#define GEOTRAIN_BENCH_SWARM_COORDINATOR_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace geotrain::swarm {

struct ProcStat {
  double cpu_s = 0;  // user + system
  double rss_mib = 0;
  int threads = 0;
};
// From the text of /proc/PID/stat and /proc/PID/status.
ProcStat ParseProc(const std::string& stat_text, const std::string& status_text);

class CoordinatorProcess {
 public:
  // `dir`: a fresh directory for the job file, state and log.
  CoordinatorProcess(std::string binary, std::string dir, std::vector<std::string> flags);
  ~CoordinatorProcess();

  // Starts it (again, on the same state and port after a kill) and waits
  // until it listens.
  absl::Status Start();
  void Kill();       // SIGKILL, and reaps it
  void Terminate();  // SIGTERM, and reaps it

  const std::string& address() const { return address_; }
  const std::string& dir() const { return dir_; }
  std::string state_dir() const { return dir_ + "/state"; }
  pid_t pid() const { return pid_; }
  // Zeros when it is not running.
  ProcStat Stat() const;

 private:
  const std::string binary_, dir_;
  const std::vector<std::string> flags_;
  std::string address_;  // 127.0.0.1:PORT, kept across restarts
  pid_t pid_ = -1;
  // /proc/PID/stat and /proc/PID/status of the running process (-1: none).
  int stat_fd_ = -1, status_fd_ = -1;
  void CloseProc();
};

}  // namespace geotrain::swarm

#endif  // GEOTRAIN_BENCH_SWARM_COORDINATOR_PROCESS_H_
