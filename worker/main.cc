// geotrain-worker: joins a coordinator and serves one pipeline stage.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "common/logging.h"
#include "common/rpc_options.h"
#include "common/stop_signals.h"
#include "worker/compute_environment.h"
#include "worker/worker.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "coordinator HOST:PORT");
ABSL_FLAG(std::string, listen, "0.0.0.0:0", "HOST:PORT for the Stage service (port 0: any)");
ABSL_FLAG(std::string, advertise, "", "HOST[:PORT] that peers should dial (default: from --listen)");
ABSL_FLAG(std::string, device, "auto", "auto, cpu, cuda or cuda:N");
ABSL_FLAG(int, threads, 0,
          "LibTorch compute threads (0: a fair share of this host's CPUs among its workers)");
ABSL_FLAG(std::string, name, "", "worker name shown in status (default: its id)");
ABSL_FLAG(std::string, route, "",
          "PEER=VIA[,...]: dial VIA (HOST:PORT, e.g. a geotrain-linkem relay) instead of the "
          "peer advertised as PEER");
ABSL_FLAG(int, join_timeout_s, 0, "give up joining after this long (0: keep trying)");
ABSL_FLAG(std::string, token, "",
          "join token from `geotrain-ctl token create` (first join; it also pins the "
          "coordinator's CA)");
ABSL_FLAG(std::string, token_file, "",
          "read the join token from this file instead (a secret mount, systemd's "
          "LoadCredential): a token on the command line shows in the process list");
ABSL_FLAG(std::string, state_dir, "",
          "keep this worker's key and certificate here, to rejoin as itself after a restart");
ABSL_FLAG(bool, insecure, false,
          "plaintext and no identities, for a coordinator started with --insecure "
          "(loopback demos and tests only)");
ABSL_FLAG(double, checkpoint_upload_mbit, 0,
          "pace of background checkpoint uploads in Mb/s; 0: from the links (half of what "
          "their microbatches leave unused, at least 5% of the slowest), -1: not paced");
ABSL_FLAG(std::string, health_listen, "",
          "HOST:PORT serving only the gRPC health service (and reflection) in plaintext, for "
          "probes without TLS (Kubernetes grpc probes); empty: off");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT serving Prometheus /metrics over plain HTTP without credentials "
          "(keep it on a private address); empty: off");
ABSL_FLAG(std::string, tls_server_name, "geotrain-coordinator",
          "the name the coordinator's certificate must carry");

namespace {
int Fail(const std::string& message) {
  std::fprintf(stderr, "geotrain-worker: %s\n", message.c_str());
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  // First of all: LibTorch's BLAS and OpenMP read their settings when they
  // load, so a worker that must change them starts itself again.
  geotrain::ReexecWithComputeEnvironment(argv);
  // Weights, gradients and model state come and go in blocks of megabytes
  // (a restore, a checkpoint snapshot, the join-time layer timings). glibc
  // would raise its mmap threshold after the first such block is freed and
  // keep later ones in its heap, so a worker's resident memory would stay
  // at its highest; with a fixed threshold every block of 4 MiB or more is
  // mapped and unmapped, and goes back to the system when freed.
  mallopt(M_MMAP_THRESHOLD, 4 << 20);
  absl::SetProgramUsageMessage(
      "geotrain-worker --coordinator=HOST:PORT [--listen=HOST:PORT] [--device=auto] "
      "[--threads=N] [--name=NAME]");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    return Fail(std::string("unexpected argument '") + positional[1] + "' (flags are --name=value)");
  }
  for (auto [flag, value, any_port] :
       {std::tuple{"coordinator", absl::GetFlag(FLAGS_coordinator), false},
        std::tuple{"listen", absl::GetFlag(FLAGS_listen), true},
        std::tuple{"metrics_listen", absl::GetFlag(FLAGS_metrics_listen), true},
        std::tuple{"health_listen", absl::GetFlag(FLAGS_health_listen), true}}) {
    const bool optional =
        std::string(flag) == "metrics_listen" || std::string(flag) == "health_listen";
    if (value.empty() && optional) continue;
    if (absl::Status valid = geotrain::ValidateHostPort(flag, value, any_port); !valid.ok()) {
      return Fail(std::string(valid.message()));
    }
  }
  if (absl::GetFlag(FLAGS_threads) < 0 || absl::GetFlag(FLAGS_threads) > 4096) {
    return Fail("--threads must be in [0, 4096] (0: a fair share of this host's CPUs)");
  }
  if (absl::GetFlag(FLAGS_join_timeout_s) < 0) return Fail("--join_timeout_s must be >= 0");
  const double upload_mbit = absl::GetFlag(FLAGS_checkpoint_upload_mbit);
  if (!(upload_mbit == -1 || (upload_mbit >= 0 && upload_mbit <= 1e6))) {
    return Fail("--checkpoint_upload_mbit must be -1 (not paced), 0 (from the links) or a rate "
                "in (0, 1e6] Mb/s");
  }
  if (absl::GetFlag(FLAGS_name).size() > 128) return Fail("--name: at most 128 bytes");
  std::string token = absl::GetFlag(FLAGS_token);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    if (!token.empty()) return Fail("--token and --token_file: pass one");
    std::ifstream file(path);
    std::stringstream text;
    text << file.rdbuf();
    if (!file) return Fail("--token_file: cannot read " + path);
    token = std::string(absl::StripAsciiWhitespace(text.str()));
    if (token.empty()) return Fail("--token_file: " + path + " is empty");
    if (token.size() > 4096) return Fail("--token_file: " + path + " holds no token (too long)");
  }
  if (absl::GetFlag(FLAGS_insecure) && !token.empty()) {
    return Fail("--token and --insecure contradict each other");
  }
  geotrain::WorkerOptions options;
  options.insecure = absl::GetFlag(FLAGS_insecure);
  options.token = token;
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  options.listen = absl::GetFlag(FLAGS_listen);
  options.advertise = absl::GetFlag(FLAGS_advertise);
  options.device = absl::GetFlag(FLAGS_device);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.name = absl::GetFlag(FLAGS_name);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.health_listen = absl::GetFlag(FLAGS_health_listen);
  options.checkpoint_pacing.fixed_bytes_per_s = upload_mbit < 0 ? -1 : upload_mbit * 1e6 / 8;
  auto routes = geotrain::ParseLinkRoutes(absl::GetFlag(FLAGS_route));
  if (!routes.ok()) {
    return Fail("--route: " + std::string(routes.status().message()));
  }
  options.routes = *std::move(routes);
  if (absl::GetFlag(FLAGS_join_timeout_s) > 0) {
    options.join_timeout = absl::Seconds(absl::GetFlag(FLAGS_join_timeout_s));
  }
  geotrain::SetLogPrefix(options.name.empty() ? "worker" : options.name);

  sigset_t signals = geotrain::BlockStopSignals();  // one thread takes them, below

  geotrain::Worker worker(options);
  std::thread signal_thread([&] {
    int received = 0;
    sigwait(&signals, &received);
    if (received == SIGTERM) {
      GT_LOG(Info) << "SIGTERM: draining (the stage goes to a standby), then stopping";
      worker.Drain();
    } else if (received == SIGINT) {
      GT_LOG(Info) << "SIGINT: stopping";
      worker.Stop();
    }
  });
  signal_thread.detach();

  const absl::Status status = worker.Run();
  if (status.code() == absl::StatusCode::kCancelled) {
    GT_LOG(Info) << "stopped (" << status.message() << ")";
    return 0;
  }
  if (!status.ok()) {
    GT_LOG(Error) << absl::StatusCodeToString(status.code()) << ": " << status.message();
    return 1;
  }
  GT_LOG(Info) << "done";
  return 0;
}
