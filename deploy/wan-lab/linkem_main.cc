// geotrain-linkem: relays TCP connections through an emulated WAN link.
//   geotrain-linkem --listen=HOST:PORT --target=HOST:PORT --delay_ms=D --rate_mbit=R
//   geotrain-linkem --listen=... --target=... --profile=tokyo-london
// Delay and rate apply to each direction. SIGUSR1 toggles the blackhole;
// SIGHUP re-reads --settings_file (delay_ms=D rate_mbit=R) and applies it to
// every connection, so a test can slow a link mid-run.
#include <pthread.h>
#include <signal.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "deploy/wan-lab/link_profile.h"
#include "deploy/wan-lab/tcp_relay.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "HOST:PORT to accept connections on");
ABSL_FLAG(std::string, target, "", "HOST:PORT to relay to (required)");
ABSL_FLAG(std::string, profile, "",
          "named link: region, virginia-ohio, us-east-west, tokyo-london, sydney-frankfurt, "
          "home-100mbit, home-10mbit (--delay_ms/--rate_mbit override its values)");
ABSL_FLAG(double, delay_ms, -1, "one-way delay in milliseconds (default 0)");
ABSL_FLAG(double, rate_mbit, -1, "rate in Mb/s of payload, each direction (default: unlimited)");
ABSL_FLAG(int, burst_kb, 16, "token-bucket depth in KiB");
ABSL_FLAG(int, queue_kb, 1024, "bytes waiting for the link before the sender is held back, KiB");
ABSL_FLAG(int64_t, close_after_bytes, 0, "fault: close each connection after this many bytes");
ABSL_FLAG(bool, blackhole, false, "fault: accept and never forward (SIGUSR1 toggles)");
ABSL_FLAG(double, blackhole_after_s, 0, "fault: become a blackhole this many seconds after start");
ABSL_FLAG(std::string, port_file, "", "write the port listened on to this file");
ABSL_FLAG(std::string, settings_file, "",
          "on SIGHUP, read delay_ms=D and/or rate_mbit=R (0: unlimited) from this file and "
          "apply them to every connection from then on");

namespace {
int Usage(const std::string& problem) {
  std::fprintf(stderr, "geotrain-linkem: %s\n", problem.c_str());
  return 2;
}
}  // namespace

namespace {

// "delay_ms=D rate_mbit=R" (either, any whitespace): a new shape from
// `current`, or why not.
absl::StatusOr<geotrain::wanlab::LinkShape> ReadSettings(const std::string& path,
                                                         geotrain::wanlab::LinkShape current) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::string word;
  while (in >> word) {
    const size_t eq = word.find('=');
    double value = 0;
    if (eq == std::string::npos || !absl::SimpleAtod(word.substr(eq + 1), &value) ||
        !std::isfinite(value) || value < 0 || value > 1e6) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": '", word, "' is not delay_ms=D or rate_mbit=R (0 <= D, R <= 1e6)"));
    }
    const std::string key = word.substr(0, eq);
    if (key == "delay_ms") {
      current.delay_us = static_cast<int64_t>(value * 1000);
    } else if (key == "rate_mbit") {
      current.rate_bps = value * 1e6;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(path, ": unknown setting '", key, "'"));
    }
  }
  return current;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "geotrain-linkem --listen=HOST:PORT --target=HOST:PORT "
      "[--profile=NAME | --delay_ms=D --rate_mbit=R] [--queue_kb=K] "
      "[--close_after_bytes=N] [--blackhole] [--blackhole_after_s=S]");
  absl::ParseCommandLine(argc, argv);
  geotrain::SetLogPrefix("linkem");

  geotrain::wanlab::RelayOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.target = absl::GetFlag(FLAGS_target);
  if (options.target.empty()) return Usage("--target=HOST:PORT is required");
  double delay_ms = 0, rate_mbit = 0;
  if (!absl::GetFlag(FLAGS_profile).empty()) {
    auto profile = geotrain::wanlab::FindLinkProfile(absl::GetFlag(FLAGS_profile));
    if (!profile.ok()) return Usage(std::string(profile.status().message()));
    delay_ms = profile->delay_ms;
    rate_mbit = profile->rate_mbit;
  }
  if (absl::GetFlag(FLAGS_delay_ms) >= 0) delay_ms = absl::GetFlag(FLAGS_delay_ms);
  if (absl::GetFlag(FLAGS_rate_mbit) >= 0) rate_mbit = absl::GetFlag(FLAGS_rate_mbit);
  if (absl::GetFlag(FLAGS_burst_kb) < 1 || absl::GetFlag(FLAGS_queue_kb) < 1) {
    return Usage("--burst_kb and --queue_kb must be at least 1");
  }
  if (absl::GetFlag(FLAGS_close_after_bytes) < 0) return Usage("--close_after_bytes must be >= 0");
  options.shape.delay_us = static_cast<int64_t>(delay_ms * 1000);
  options.shape.rate_bps = rate_mbit * 1e6;
  options.shape.burst_bytes = int64_t{absl::GetFlag(FLAGS_burst_kb)} * 1024;
  options.shape.queue_bytes = int64_t{absl::GetFlag(FLAGS_queue_kb)} * 1024;
  options.close_after_bytes = absl::GetFlag(FLAGS_close_after_bytes);
  options.blackhole = absl::GetFlag(FLAGS_blackhole);

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGUSR1);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  geotrain::wanlab::TcpRelay relay(options);
  auto port = relay.Start();
  if (!port.ok()) {
    std::fprintf(stderr, "geotrain-linkem: %s\n", std::string(port.status().message()).c_str());
    return 1;
  }
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    const std::string path = absl::GetFlag(FLAGS_port_file);
    {
      std::ofstream out(path + ".tmp");
      out << *port << "\n";
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
  }
  GT_LOG(Info) << "relaying port " << *port << " -> " << options.target << ": delay "
               << delay_ms << " ms, rate " << (rate_mbit > 0 ? std::to_string(rate_mbit) : "unlimited")
               << " Mb/s each way, queue " << options.shape.queue_bytes / 1024 << " KiB"
               << (options.blackhole ? ", blackhole" : "");

  if (absl::GetFlag(FLAGS_blackhole_after_s) > 0) {
    std::thread([&relay, after = absl::GetFlag(FLAGS_blackhole_after_s)] {
      std::this_thread::sleep_for(std::chrono::duration<double>(after));
      relay.SetBlackhole(true);
      GT_LOG(Info) << "blackhole on";
    }).detach();
  }
  while (true) {
    int received = 0;
    sigwait(&signals, &received);
    if (received == SIGUSR1) {
      relay.SetBlackhole(!relay.blackhole());
      GT_LOG(Info) << "blackhole " << (relay.blackhole() ? "on" : "off");
      continue;
    }
    if (received == SIGHUP) {
      const std::string path = absl::GetFlag(FLAGS_settings_file);
      if (path.empty()) {
        GT_LOG(Warning) << "SIGHUP without --settings_file: nothing to read";
        continue;
      }
      absl::StatusOr<geotrain::wanlab::LinkShape> shape = ReadSettings(path, relay.shape());
      if (!shape.ok()) {
        GT_LOG(Warning) << "settings not applied: " << shape.status().message();
        continue;
      }
      relay.SetShape(*shape);
      GT_LOG(Info) << "settings applied: delay " << shape->delay_us / 1000.0 << " ms, rate "
                   << (shape->rate_bps > 0 ? std::to_string(shape->rate_bps / 1e6) : "unlimited")
                   << " Mb/s each way";
      continue;
    }
    break;
  }
  const geotrain::wanlab::RelayTotals totals = relay.totals();
  relay.Stop();
  GT_LOG(Info) << "stopped: " << totals.connections << " connections, "
               << totals.bytes_forwarded << " bytes forwarded, " << totals.bytes_dropped
               << " dropped";
  return 0;
}
