// geotrain-relay: splices links between workers that cannot dial each other.
#include <signal.h>

#include <cstdio>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "common/logging.h"
#include "common/rpc_options.h"
#include "common/stop_signals.h"
#include "relay/relay_daemon.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "coordinator HOST:PORT");
ABSL_FLAG(std::string, listen, "0.0.0.0:7400", "HOST:PORT workers dial (port 0: any)");
ABSL_FLAG(std::string, advertise, "",
          "HOST[:PORT] that workers should dial (default: from --listen); must be reachable "
          "from every worker");
ABSL_FLAG(std::string, name, "", "name shown in status (default: its id)");
ABSL_FLAG(int, join_timeout_s, 0, "give up joining after this long (0: keep trying)");
ABSL_FLAG(std::string, token, "",
          "join token from `geotrain-ctl token create` (first start; later starts use "
          "--state_dir)");
ABSL_FLAG(std::string, state_dir, "", "keeps this relay's key and certificate across restarts");
ABSL_FLAG(bool, insecure, false,
          "plaintext, no identities: for a coordinator started with --insecure");
ABSL_FLAG(std::string, tls_server_name, "geotrain-coordinator",
          "the name the coordinator's certificate must carry");
ABSL_FLAG(int, pair_timeout_s, 60, "how long one end of a link waits for the other");
ABSL_FLAG(int, max_links, 512, "links spliced at once");

namespace {
int Fail(const std::string& message) {
  std::fprintf(stderr, "geotrain-relay: %s\n", message.c_str());
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "geotrain-relay --coordinator=HOST:PORT --token=TOKEN --listen=HOST:PORT "
      "[--advertise=HOST:PORT] [--insecure]");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    return Fail(std::string("unexpected argument '") + positional[1] + "' (flags are --name=value)");
  }
  for (auto [flag, value, any_port] :
       {std::tuple{"coordinator", absl::GetFlag(FLAGS_coordinator), false},
        std::tuple{"listen", absl::GetFlag(FLAGS_listen), true}}) {
    if (absl::Status valid = geotrain::ValidateHostPort(flag, value, any_port); !valid.ok()) {
      return Fail(std::string(valid.message()));
    }
  }
  if (absl::GetFlag(FLAGS_insecure) && !absl::GetFlag(FLAGS_token).empty()) {
    return Fail("--token and --insecure contradict each other");
  }
  if (absl::GetFlag(FLAGS_name).size() > 128) return Fail("--name: at most 128 bytes");
  if (absl::GetFlag(FLAGS_join_timeout_s) < 0) return Fail("--join_timeout_s must be >= 0");
  if (absl::GetFlag(FLAGS_pair_timeout_s) < 1 || absl::GetFlag(FLAGS_pair_timeout_s) > 3600) {
    return Fail("--pair_timeout_s must be in [1, 3600]");
  }
  if (absl::GetFlag(FLAGS_max_links) < 1 || absl::GetFlag(FLAGS_max_links) > 65536) {
    return Fail("--max_links must be in [1, 65536]");
  }
  geotrain::RelayDaemonOptions options;
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  options.listen = absl::GetFlag(FLAGS_listen);
  options.advertise = absl::GetFlag(FLAGS_advertise);
  options.name = absl::GetFlag(FLAGS_name);
  options.insecure = absl::GetFlag(FLAGS_insecure);
  options.token = absl::GetFlag(FLAGS_token);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (absl::GetFlag(FLAGS_join_timeout_s) > 0) {
    options.join_timeout = absl::Seconds(absl::GetFlag(FLAGS_join_timeout_s));
  }
  options.splice.pair_timeout = absl::Seconds(absl::GetFlag(FLAGS_pair_timeout_s));
  options.splice.max_pairs = absl::GetFlag(FLAGS_max_links);
  geotrain::SetLogPrefix(options.name.empty() ? "relay" : options.name);

  sigset_t signals = geotrain::BlockStopSignals();  // one thread takes them, below
  geotrain::RelayDaemon relay(options);
  std::thread signal_thread([&] {
    int received = 0;
    sigwait(&signals, &received);
    GT_LOG(Info) << "signal " << received << ": stopping";
    relay.Stop();
  });
  signal_thread.detach();
  const absl::Status status = relay.Run();
  if (status.code() == absl::StatusCode::kCancelled) return 0;
  if (!status.ok()) {
    GT_LOG(Error) << absl::StatusCodeToString(status.code()) << ": " << status.message();
    return 1;
  }
  return 0;
}
