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
ProcStat ReadProc(pid_t pid);

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
  ProcStat Stat() const { return ReadProc(pid_); }

 private:
  const std::string binary_, dir_;
  const std::vector<std::string> flags_;
  std::string address_;  // 127.0.0.1:PORT, kept across restarts
  pid_t pid_ = -1;
};

}  // namespace geotrain::swarm

#endif  // GEOTRAIN_BENCH_SWARM_COORDINATOR_PROCESS_H_
