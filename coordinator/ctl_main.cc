// geotrain-ctl: the operator's CLI.
//   geotrain-ctl status --coordinator=HOST:PORT [--json | --brief]
//   geotrain-ctl token create [--ttl=24h] [--uses=N] [--name=LABEL] [--role=worker|viewer|relay]
//   geotrain-ctl token list
//   geotrain-ctl token revoke ID_OR_TOKEN
//   geotrain-ctl worker revoke ID
//   geotrain-ctl health [--target=HOST:PORT] [--service=NAME] [--live]
//   geotrain-ctl watch [--interval=1s] [--frames=N]
// Credentials: --admin_credential=FILE (<state_dir>/tls/admin.credential,
// or a worker's credential for status), --token=TOKEN (status with a
// viewer token), or --insecure for a coordinator started with --insecure.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/join_token.h"
#include "common/rpc_options.h"
#include "common/transport_security.h"
#include "common/x509.h"
#include "coordinator/watch_view.h"
#include "geotrain/v1/coordinator.grpc.pb.h"
#include "geotrain/v1/status.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "coordinator HOST:PORT");
ABSL_FLAG(bool, json, false, "print the status as JSON");
ABSL_FLAG(bool, brief, false, "print one line: state, step, loss, samples/s");
ABSL_FLAG(int, timeout_ms, 3000, "deadline of the status call");
ABSL_FLAG(bool, explain, false, "plan: per stage, the predicted compute, link time and why");
ABSL_FLAG(int, events, 8, "how many recent events to show (table only)");
ABSL_FLAG(int, page_size, -1,
          "status: members per page (default: 50 in the table, every member with --json)");
ABSL_FLAG(std::string, page_token, "", "status: the page a previous one named (next page)");
ABSL_FLAG(std::string, state, "",
          "status: only members in this state (training, standby, dead, left, done)");
ABSL_FLAG(int, stage, -1, "status: only the members of this stage");
ABSL_FLAG(int, pipeline, -1, "status: only the members of this pipeline");
ABSL_FLAG(std::string, name, "", "token create: a label shown by token list; status: only "
          "members whose name or id contains it");
ABSL_FLAG(std::string, admin_credential, "",
          "credential file: the coordinator's <state_dir>/tls/admin.credential (or a worker's)");
ABSL_FLAG(std::string, token, "", "a viewer token (status only); it also pins the CA");
ABSL_FLAG(bool, insecure, false, "plaintext, for a coordinator started with --insecure");
ABSL_FLAG(std::string, tls_server_name, "geotrain-coordinator",
          "the name the coordinator's certificate must carry");
ABSL_FLAG(absl::Duration, ttl, absl::Hours(24), "token create: how long the token is valid");
ABSL_FLAG(int, uses, 0, "token create: how many workers may enroll with it (0: unlimited)");
ABSL_FLAG(std::string, role, "worker",
          "token create: worker, viewer (status only) or relay (geotrain-relay only)");
ABSL_FLAG(bool, keep_workers, false,
          "token revoke: keep the workers enrolled with the token (default: revoke them too)");
ABSL_FLAG(std::string, out, "", "export: the directory to write the model into");
ABSL_FLAG(int, export_timeout_s, 600, "export: deadline of the whole transfer");
ABSL_FLAG(std::string, target, "",
          "health: the daemon to ask, coordinator or worker (default: --coordinator)");
ABSL_FLAG(std::string, service, "", "health: a service's full name (default: the whole server)");
ABSL_FLAG(bool, live, false,
          "health: exit 0 on any answer, SERVING or not (a liveness probe)");
ABSL_FLAG(bool, watch, false,
          "health: print each status change (grpc.health.v1 Watch) until --watch_for, "
          "Ctrl-C or the daemon ends");
ABSL_FLAG(absl::Duration, watch_for, absl::InfiniteDuration(), "health --watch: how long");
ABSL_FLAG(absl::Duration, interval, absl::Seconds(1), "watch: time between frames");
ABSL_FLAG(int, frames, 0, "watch: stop after this many frames (0: at Ctrl-C)");

namespace {

void PrintBrief(const geotrain::v1::ClusterStatus& s) {
  int training = 0;
  for (const auto& w : s.workers()) {
    training += w.state() == geotrain::v1::WORKER_STATE_TRAINING;
  }
  std::printf("[%6.1fs] %-8s step %4d/%d  loss %.4f  samples/s %7.1f  workers %d/%d",
              s.elapsed_s(), s.state().c_str(), s.step(), s.steps(), s.loss(),
              s.samples_per_s(), training, s.workers_size());
  if (s.val_loss() > 0) std::printf("  val_loss %.4f", s.val_loss());
  if (s.accuracy() > 0) std::printf("  accuracy %.4f", s.accuracy());
  std::printf("\n");
}

// The members at a glance, before any of them: how many in each state,
// and each stage's layers and workers.
void PrintSummary(const geotrain::v1::ClusterStatus& s) {
  std::string states;
  for (const char* state : {"training", "standby", "done", "dead", "left"}) {
    auto it = s.worker_states().find(state);
    if (it != s.worker_states().end() && it->second > 0) {
      absl::StrAppend(&states, states.empty() ? "" : ", ", it->second, " ", state);
    }
  }
  std::printf("members %d%s%s\n", s.workers_total(), states.empty() ? "" : ": ", states.c_str());
  if (s.stage_summary_size() > 0) {
    std::string stages;
    for (const auto& stage : s.stage_summary()) {
      absl::StrAppendFormat(&stages, "%s%d [%d,%d) x%d", stages.empty() ? "" : "  ",
                            stage.stage(), stage.layer_begin(), stage.layer_end(),
                            stage.workers());
    }
    std::printf("stages %s\n", stages.c_str());
  }
  if (!s.next_page_token().empty()) {
    std::printf("showing %d of the %d matching members; next page: --page_token=%s\n",
                s.workers_size(), s.workers_matched(), s.next_page_token().c_str());
  } else if (s.workers_matched() != s.workers_total()) {
    std::printf("showing the %d matching members\n", s.workers_matched());
  }
}

void PrintTable(const geotrain::v1::ClusterStatus& s) {
  std::printf("job %s  state %s  schedule %s  epoch %lu\n", s.job().c_str(),
              s.state().c_str(), s.schedule().c_str(),
              static_cast<unsigned long>(s.epoch()));
  std::printf("step %d/%d  loss %.4f  samples %ld  samples/s %.1f  elapsed %.0fs",
              s.step(), s.steps(), s.loss(), static_cast<long>(s.samples()),
              s.samples_per_s(), s.elapsed_s());
  if (s.val_loss() > 0) std::printf("  val_loss %.4f", s.val_loss());
  if (s.accuracy() > 0) std::printf("  accuracy %.4f", s.accuracy());
  if (!s.security().empty()) std::printf("\nsecurity %s", s.security().c_str());
  std::printf("\n");
  PrintSummary(s);
  std::printf("\n%-4s %-12s %-22s %-7s %8s %5s %-8s %-9s %6s %8s %5s %5s\n", "ID",
              "NAME", "ADDRESS", "DEVICE", "GFLOP/s", "STAGE", "LAYERS",
              "STATE", "HB_AGE", "RSS_MiB", "STEP", "REACH");
  for (const auto& w : s.workers()) {
    std::string layers =
        w.stage() >= 0 ? absl::StrFormat("[%d,%d)", w.layer_begin(), w.layer_end())
                       : "-";
    // With pipelines a worker shows as STAGE/pR; a replica routed to within
    // the one pipeline as STAGE.K (K > 0); the primary as the stage alone.
    std::string stage = w.stage() < 0          ? "-"
                        : s.pipelines() > 1    ? absl::StrFormat("%d/p%d", w.stage(), w.pipeline())
                        : w.replica() > 0      ? absl::StrFormat("%d.%d", w.stage(), w.replica())
                                               : std::to_string(w.stage());
    const std::string device = w.role() == "relay" ? "relay" : w.device();
    std::printf("%-4s %-12s %-22s %-7s %8.1f %5s %-8s %-9s %5.1fs %8.1f %5d %5s\n",
                w.id().c_str(), w.name().c_str(), w.address().c_str(),
                device.c_str(), w.gflops(), stage.c_str(), layers.c_str(),
                geotrain::WorkerStateName(w.state()).c_str(), w.heartbeat_age_s(),
                w.rss_bytes() / 1048576.0, w.step(), w.reachable() ? "yes" : "NO");
  }
  for (const auto& w : s.workers()) {
    if (!w.reachable()) std::printf("%-4s not reachable: %s\n", w.id().c_str(),
                                    w.reachability().c_str());
  }
  if (s.pipelines() > 1) {
    std::printf("\n%-8s %6s %9s %10s  %s\n", "PIPELINE", "STEP", "LOSS", "SAMPLES/s",
                "WORKERS (stage 0 first)");
    for (const auto& p : s.pipeline_status()) {
      std::printf("%-8d %6d %9.4f %10.1f  %s\n", p.pipeline(), p.step(), p.loss(),
                  p.samples_per_s(), absl::StrJoin(p.workers(), " -> ").c_str());
    }
    // The outer sync per worker: rounds applied and what crossed its
    // replica links.
    std::printf("\n%-4s %5s %12s %9s %9s\n", "ID", "STAGE", "OUTER_ROUNDS", "SENT_MiB",
                "RECV_MiB");
    for (const auto& w : s.workers()) {
      if (w.stage() < 0) continue;
      std::printf("%-4s %5s %12d %9.2f %9.2f\n", w.id().c_str(),
                  absl::StrFormat("%d/p%d", w.stage(), w.pipeline()).c_str(), w.outer_rounds(),
                  w.outer_bytes_sent() / 1048576.0, w.outer_bytes_received() / 1048576.0);
    }
  }
  if (s.links_size() > 0) {
    std::printf("\n%-6s %-10s %-10s %-10s  %s\n", "LINK", "UPSTREAM", "DOWNSTREAM", "DIALER",
                "VIA / WHY");
    for (const auto& l : s.links()) {
      // An outer-sync link joins a stage's replica to its reducer.
      const std::string stages =
          l.outer() ? absl::StrFormat("%d=%d", l.upstream_stage(), l.upstream_stage())
                    : absl::StrFormat("%d->%d", l.upstream_stage(), l.upstream_stage() + 1);
      const std::string via =
          l.dialer() == "relay"
              ? absl::StrCat("relay ", l.relay_worker(), " at ", l.relay_address())
              : l.reason();
      std::printf("%-6s %-10s %-10s %-10s  %s\n", stages.c_str(), l.upstream_worker().c_str(),
                  l.downstream_worker().c_str(), l.dialer().c_str(), via.c_str());
    }
  }
  std::printf("\n%-4s %-7s %7s %9s  %s\n", "ID", "DEVICE", "THREADS", "MEM_GiB", "BLAS");
  for (const auto& w : s.workers()) {
    if (w.role() == "relay") continue;  // no device
    std::printf("%-4s %-7s %7d %9.1f  %s\n", w.id().c_str(), w.device().c_str(), w.threads(),
                w.memory_bytes() / 1073741824.0, w.blas().c_str());
    if (!w.threads_reason().empty()) std::printf("     threads: %s\n", w.threads_reason().c_str());
    if (!w.environment().empty()) std::printf("     environment: %s\n", w.environment().c_str());
  }
  std::printf("\n%-4s %5s %-11s %8s %9s %9s %9s %7s %9s %10s\n", "ID", "STAGE", "SCHEDULE",
              "VERSIONS", "W_MiB", "STALE_MAX", "STALE_AVG", "BUBBLE", "MB/s", "BUSY_ms/MB");
  for (const auto& w : s.workers()) {
    if (w.stage() < 0 || w.schedule().empty()) continue;
    std::printf("%-4s %5d %-11s %4d/%-3d %9.2f %9ld %9.2f %7.3f %9.2f %10.1f\n", w.id().c_str(),
                w.stage(), w.schedule().c_str(), w.weight_versions(), w.max_weight_versions(),
                w.weight_bytes() / 1048576.0, static_cast<long>(w.staleness_max()),
                w.staleness_mean(), w.bubble_fraction(), w.microbatches_per_s(),
                w.compute_s_per_microbatch() * 1000);
  }
  bool header = false;
  for (const auto& w : s.workers()) {
    for (const auto& l : w.links()) {
      if (!header) {
        std::printf("\n%-4s %-10s %-22s %-5s %9s %9s %9s %6s %8s %8s %7s %8s %8s\n", "ID",
                    "DIRECTION", "PEER", "CODEC", "SENT_MiB", "RAW_MiB", "RECV_MiB", "RATIO",
                    "GOODPUT", "LINK", "SEND_S", "LINK_MS", "COMP_MS");
        header = true;
      }
      std::printf("%-4s %-10s %-22s %-5s %9.1f %9.1f %9.1f %6.2f %8.1f %8.1f %7.2f %8.1f %8.1f\n",
                  w.id().c_str(), l.direction().c_str(), l.peer().c_str(), l.codec().c_str(),
                  l.bytes_sent() / 1048576.0, l.raw_bytes_sent() / 1048576.0,
                  l.bytes_received() / 1048576.0, l.compression_ratio(), l.goodput_bps() / 1e6,
                  l.link_rate_bps() / 1e6, l.send_s(), l.link_s_per_microbatch() * 1e3,
                  l.compute_s_per_microbatch() * 1e3);
      if (l.adaptive()) std::printf("     codec: %s\n", l.codec_reason().c_str());
    }
  }
  header = false;
  for (const auto& w : s.workers()) {
    if (w.routes_size() < 2) continue;  // one route: nothing to choose
    for (const auto& r : w.routes()) {
      if (!header) {
        std::printf("\n%-4s %-22s %9s %11s %10s %10s   (routing among replicas)\n", "ID",
                    "TO", "SENT", "OUTSTANDING", "LAT_ms", "OLDEST_ms");
        header = true;
      }
      std::printf("%-4s %-22s %9lu %11d %10.1f %10.1f\n", w.id().c_str(), r.peer().c_str(),
                  static_cast<unsigned long>(r.sent()), r.outstanding(), r.latency_s() * 1e3,
                  r.oldest_outstanding_s() * 1e3);
    }
  }
  if (s.has_audits()) {
    const auto& a = s.audits();
    std::printf("\nspot checks (fraction %g): %ld drawn, %ld passed, %ld failed, %ld verifiers "
                "caught, %ld undecided (%ld disputed, %ld expired), %d open\n",
                a.fraction(), static_cast<long>(a.drawn()), static_cast<long>(a.passed()),
                static_cast<long>(a.failed()), static_cast<long>(a.verifiers_caught()),
                static_cast<long>(a.undecided()), static_cast<long>(a.disputes()),
                static_cast<long>(a.expired()), a.open());
    for (const auto& w : s.workers()) {
      if (w.audits_passed() + w.audits_failed() == 0) continue;
      std::printf("%-4s audits: %ld passed, %ld failed%s\n", w.id().c_str(),
                  static_cast<long>(w.audits_passed()), static_cast<long>(w.audits_failed()),
                  w.audits_failed() > 0 ? "  FAILED SPOT CHECK" : "");
    }
  }
  for (const auto& w : s.workers()) {
    if (!w.suspected().empty()) {
      std::printf("%-4s SUSPECTED: %s\n", w.id().c_str(), w.suspected().c_str());
    }
    for (const auto& n : w.output_norms()) {
      if (!n.suspicion().empty()) {
        std::printf("%-4s OUTPUTS SUSPECT: %s (rms %.4g, replicas %.4g, history %.4g)\n",
                    w.id().c_str(), n.suspicion().c_str(), n.rms(), n.replicas_rms(),
                    n.history_rms());
      }
    }
  }
  for (const auto& w : s.workers()) {
    if (w.weight_averages() > 0) {
      std::printf("%-4s stage %d replica %d: %ld weight averages with its replicas\n",
                  w.id().c_str(), w.stage(), w.replica(), static_cast<long>(w.weight_averages()));
    }
  }
  const int shown = std::min(absl::GetFlag(FLAGS_events), s.events_size());
  if (shown > 0) std::printf("\nrecent events:\n");
  for (int i = s.events_size() - shown; i < s.events_size(); ++i) {
    const auto& e = s.events(i);
    std::printf("  %7.1fs %-11s %-10s %s\n", e.time_s(), e.kind().c_str(),
                e.worker().c_str(), e.detail().c_str());
  }
}

}  // namespace

namespace {

constexpr char kUsage[] =
    "usage: geotrain-ctl COMMAND --coordinator=HOST:PORT (--admin_credential=FILE | "
    "--token=TOKEN | --insecure)\n"
    "  status [--json | --brief] [--page_size=N] [--page_token=T] [--state=S] [--stage=K]\n"
    "      [--pipeline=R] [--name=TEXT]: a summary first, then a page of the members\n"
    "  plan [--explain]\n"
    "  network\n"
    "  token create [--ttl=24h] [--uses=N] [--name=LABEL] [--role=worker|viewer|relay]\n"
    "  token list\n"
    "  token revoke ID_OR_TOKEN [--keep_workers]: also revokes its workers unless kept\n"
    "  worker revoke ID\n"
    "  export --out=DIR [--export_timeout_s=600]\n"
    "  health [--target=HOST:PORT] [--service=NAME] [--live] [--watch [--watch_for=D]]:\n"
    "      the standard gRPC health status of a coordinator or worker; exit 0 if SERVING,\n"
    "      1 if not, 3 if no answer (--live: 0 on any answer)\n"
    "  watch [--interval=1s] [--frames=N] [--events=8]: workers, stages, links and the last\n"
    "      events, redrawn every interval until Ctrl-C (in a pipe: one block per interval)\n";

int Fail(const std::string& message) {
  std::fprintf(stderr, "geotrain-ctl: %s\n", message.c_str());
  return 1;
}

// A flag out of range: exit 2, as for a usage error.
int UsageError(const std::string& message) {
  Fail(message);
  return 2;
}

// How this invocation talks to the coordinator.
struct Connection {
  std::shared_ptr<grpc::Channel> channel;
  std::string token;  // sent as metadata (viewer token)
};

absl::StatusOr<Connection> Connect(const std::string& address) {
  Connection connection;
  const std::string server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (absl::GetFlag(FLAGS_insecure)) {
    connection.channel = geotrain::MakeChannel(address);
  } else if (!absl::GetFlag(FLAGS_admin_credential).empty()) {
    absl::StatusOr<geotrain::TransportSecurity> security =
        geotrain::LoadCredentialFile(absl::GetFlag(FLAGS_admin_credential));
    if (!security.ok()) return security.status();
    connection.channel = geotrain::MakeSecureChannel(address, *security, server_name);
  } else if (!absl::GetFlag(FLAGS_token).empty()) {
    absl::StatusOr<geotrain::JoinToken> token = geotrain::ParseJoinToken(absl::GetFlag(FLAGS_token));
    if (!token.ok()) return token.status();
    absl::StatusOr<std::string> ca =
        geotrain::PinCertificateAuthority(address, token->ca_fingerprint, absl::Seconds(5));
    if (!ca.ok()) return ca.status();
    geotrain::TransportSecurity security;
    security.insecure = false;
    security.trusted_ca_pem = *ca;
    connection.channel = geotrain::MakeSecureChannel(address, security, server_name);
    connection.token = absl::GetFlag(FLAGS_token);
  } else {
    return absl::UnauthenticatedError(
        "no credential: pass --admin_credential=<state_dir>/tls/admin.credential, "
        "--token=TOKEN (a viewer token, status only), or --insecure");
  }
  return connection;
}

std::unique_ptr<grpc::ClientContext> NewContext(const Connection& connection) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(geotrain::DeadlineFromNow(
      std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms))));
  if (!connection.token.empty()) {
    context->AddMetadata(geotrain::kTokenMetadataKey, connection.token);
  }
  return context;
}

int RpcFailed(const std::string& what, const std::string& address, const grpc::Status& rpc) {
  return Fail(absl::StrCat(what, " at ", address, " failed: ", rpc.error_message(), " (",
                           rpc.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                               ? "deadline exceeded: is the coordinator running?"
                               : rpc.error_code() == grpc::StatusCode::UNAVAILABLE
                                     ? "unreachable, or a TLS/--insecure mismatch"
                                     : "refused",
                           ")"));
}

std::string RoleName(geotrain::v1::TokenRole role) {
  return role == geotrain::v1::TOKEN_ROLE_VIEWER  ? "viewer"
         : role == geotrain::v1::TOKEN_ROLE_RELAY ? "relay"
                                                  : "worker";
}

int TokenCommand(const std::vector<std::string>& args, const Connection& connection,
                 const std::string& address) {
  auto stub = geotrain::v1::Admin::NewStub(connection.channel);
  const std::string& verb = args[2];
  if (verb == "create" && args.size() == 3) {
    geotrain::v1::CreateTokenRequest request;
    const absl::Duration ttl = absl::GetFlag(FLAGS_ttl);
    if (ttl <= absl::ZeroDuration()) return UsageError("--ttl must be positive (e.g. 24h, 30m)");
    if (absl::GetFlag(FLAGS_uses) < 0) return UsageError("--uses must be >= 0 (0: unlimited)");
    const std::string role = absl::GetFlag(FLAGS_role);
    if (role != "worker" && role != "viewer" && role != "relay") {
      return UsageError("--role must be worker, viewer or relay");
    }
    request.set_ttl_s(absl::ToInt64Seconds(ttl));
    request.set_uses(absl::GetFlag(FLAGS_uses));
    request.set_label(absl::GetFlag(FLAGS_name));
    request.set_role(role == "viewer"  ? geotrain::v1::TOKEN_ROLE_VIEWER
                     : role == "relay" ? geotrain::v1::TOKEN_ROLE_RELAY
                                       : geotrain::v1::TOKEN_ROLE_WORKER);
    geotrain::v1::CreateTokenResponse response;
    grpc::Status rpc = stub->CreateToken(NewContext(connection).get(), request, &response);
    if (!rpc.ok()) return RpcFailed("token create", address, rpc);
    std::printf("%s\n", response.token().c_str());  // alone on stdout, for scripts
    return 0;
  }
  if (verb == "list" && args.size() == 3) {
    geotrain::v1::ListTokensResponse response;
    grpc::Status rpc = stub->ListTokens(NewContext(connection).get(),
                                        geotrain::v1::ListTokensRequest(), &response);
    if (!rpc.ok()) return RpcFailed("token list", address, rpc);
    std::printf("%-6s  %-16s  %-6s  %-9s  %-20s  %-8s  %s\n", "ID", "LABEL", "ROLE", "USES LEFT",
                "EXPIRES (UTC)", "STATE", "WORKERS");
    const int64_t now = absl::ToUnixSeconds(absl::Now());
    for (const geotrain::v1::TokenInfo& t : response.tokens()) {
      const std::string uses = t.uses_left() < 0 ? "unlimited" : std::to_string(t.uses_left());
      const std::string state = t.revoked()                   ? "revoked"
                                : now >= t.expires_unix_s()   ? "expired"
                                : t.uses_left() == 0          ? "used up"
                                                              : "valid";
      std::printf("%-6s  %-16s  %-6s  %-9s  %-20s  %-8s  %s\n", t.id().c_str(),
                  t.label().c_str(), RoleName(t.role()).c_str(), uses.c_str(),
                  absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixSeconds(t.expires_unix_s()),
                                   absl::UTCTimeZone())
                      .c_str(),
                  state.c_str(), absl::StrJoin(t.workers(), ",").c_str());
    }
    return 0;
  }
  if (verb == "revoke" && args.size() == 4) {
    geotrain::v1::RevokeTokenRequest request;
    request.set_id_or_token(args[3]);
    request.set_keep_workers(absl::GetFlag(FLAGS_keep_workers));
    geotrain::v1::RevokeTokenResponse response;
    grpc::Status rpc = stub->RevokeToken(NewContext(connection).get(), request, &response);
    if (!rpc.ok()) return RpcFailed("token revoke", address, rpc);
    std::printf("revoked token %s (%s)%s\n", response.info().id().c_str(),
                response.info().label().c_str(),
                response.revoked_workers().empty()
                    ? ""
                    : absl::StrCat(" and the workers enrolled with it: ",
                                   absl::StrJoin(response.revoked_workers(), ","))
                          .c_str());
    return 0;
  }
  std::fprintf(stderr, "%s", kUsage);
  return 2;
}

int WorkerCommand(const std::vector<std::string>& args, const Connection& connection,
                  const std::string& address) {
  if (args.size() != 4 || args[2] != "revoke") {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  auto stub = geotrain::v1::Admin::NewStub(connection.channel);
  geotrain::v1::RevokeWorkerRequest request;
  request.set_worker_id(args[3]);
  geotrain::v1::RevokeWorkerResponse response;
  grpc::Status rpc = stub->RevokeWorker(NewContext(connection).get(), request, &response);
  if (!rpc.ok()) return RpcFailed("worker revoke", address, rpc);
  std::printf("revoked worker %s%s\n", args[3].c_str(),
              response.was_live() ? " (its lease ended now)" : " (it was not live)");
  return 0;
}

// `export`: the newest complete model, written into --out file by file
// (each to a temporary name, renamed when whole).
int ExportCommand(const Connection& connection, const std::string& address) {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return UsageError("export needs --out=DIR");
  if (absl::GetFlag(FLAGS_export_timeout_s) <= 0) {
    return UsageError("--export_timeout_s must be > 0");
  }
  std::error_code error;
  std::filesystem::create_directories(out, error);
  if (error) return Fail(absl::StrCat("cannot create ", out, ": ", error.message()));
  auto stub = geotrain::v1::Admin::NewStub(connection.channel);
  grpc::ClientContext context;
  context.set_deadline(geotrain::DeadlineFromNow(
      std::chrono::seconds(absl::GetFlag(FLAGS_export_timeout_s))));
  if (!connection.token.empty()) context.AddMetadata(geotrain::kTokenMetadataKey, connection.token);
  auto reader = stub->ExportModel(&context, geotrain::v1::ExportModelRequest());
  geotrain::v1::ExportFileChunk chunk;
  std::ofstream file;
  std::string name, tmp;
  uint64_t expected = 0, written = 0, total = 0;
  int step = -1;
  std::vector<std::string> files;
  while (reader->Read(&chunk)) {
    if (!chunk.file().empty()) {
      name = chunk.file();
      // A name from the coordinator, written under --out only.
      if (name.find('/') != std::string::npos || name == "." || name == ".." ||
          file.is_open()) {
        context.TryCancel();
        return Fail(absl::StrCat("the coordinator sent a bad file name '", name.substr(0, 64),
                                 "'"));
      }
      tmp = absl::StrCat(out, "/.", name, ".tmp");
      file.open(tmp, std::ios::binary | std::ios::trunc);
      if (!file) return Fail("cannot write " + tmp);
      expected = chunk.size();
      written = 0;
      step = chunk.step();
    } else if (!file.is_open()) {
      context.TryCancel();
      return Fail("the coordinator sent data outside a file");
    }
    written += chunk.data().size();
    if (written > expected) {
      context.TryCancel();
      return Fail(absl::StrCat(name, ": more than the announced ", expected, " bytes"));
    }
    file.write(chunk.data().data(), static_cast<std::streamsize>(chunk.data().size()));
    if (chunk.last()) {
      file.close();
      if (!file || written != expected) return Fail(absl::StrCat("writing ", name, " failed"));
      std::filesystem::rename(tmp, out + "/" + name, error);
      if (error) return Fail(absl::StrCat("rename ", tmp, ": ", error.message()));
      files.push_back(name);
      total += written;
    }
  }
  const grpc::Status rpc = reader->Finish();
  if (!rpc.ok()) return RpcFailed("export", address, rpc);
  if (file.is_open()) return Fail(absl::StrCat("the export ended inside ", name));
  std::printf("exported step %d to %s: %s (%.1f MB)\n", step, out.c_str(),
              absl::StrJoin(files, ", ").c_str(), total / 1e6);
  return 0;
}

// `health`: grpc.health.v1.Health/Check on --target. Exit 0 when SERVING
// (or, with --live, on any answer), 1 when not, 3 without an answer.
int HealthCommand(const Connection& connection, const std::string& address) {
  auto stub = grpc::health::v1::Health::NewStub(connection.channel);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  if (absl::GetFlag(FLAGS_watch)) {
    if (absl::GetFlag(FLAGS_watch_for) <= absl::ZeroDuration()) {
      return UsageError("--watch_for must be positive");
    }
    grpc::ClientContext context;
    if (absl::GetFlag(FLAGS_watch_for) != absl::InfiniteDuration()) {
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_watch_for)));
    }
    if (!connection.token.empty()) context.AddMetadata(geotrain::kTokenMetadataKey, connection.token);
    std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>> reader =
        stub->Watch(&context, request);
    int changes = 0;
    while (reader->Read(&response)) {
      ++changes;
      std::printf("%s %s: %s\n", absl::FormatTime("%H:%M:%E3S", absl::Now(), absl::UTCTimeZone()).c_str(),
                  address.c_str(),
                  grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())
                      .c_str());
      std::fflush(stdout);
    }
    const grpc::Status ended = reader->Finish();
    if (ended.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && changes > 0) return 0;
    RpcFailed("health watch", address, ended);
    return 3;
  }
  const grpc::Status rpc = stub->Check(NewContext(connection).get(), request, &response);
  if (!rpc.ok()) {
    if (rpc.error_code() == grpc::StatusCode::NOT_FOUND) {
      Fail(absl::StrCat(address, " does not know the service '", request.service(), "'"));
      return absl::GetFlag(FLAGS_live) ? 0 : 1;
    }
    RpcFailed("health", address, rpc);
    return 3;
  }
  const std::string status =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  std::printf("%s%s%s: %s\n", address.c_str(), request.service().empty() ? "" : " ",
              request.service().c_str(), status.c_str());
  if (absl::GetFlag(FLAGS_live)) return 0;
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

std::atomic<bool> g_interrupted{false};
void OnInterrupt(int) { g_interrupted = true; }

// Redraws the status every --interval until Ctrl-C (or --frames). On a
// terminal each frame replaces the last (cursor home, clear); in a pipe
// the frames follow one another, separated by a blank line, with no escape
// codes. A failed call shows its error as the frame and the next one tries
// again.
int WatchCommand(const Connection& connection, const std::string& address) {
  const absl::Duration interval = absl::GetFlag(FLAGS_interval);
  if (interval < absl::Milliseconds(100)) return UsageError("--interval must be at least 100ms");
  if (absl::GetFlag(FLAGS_frames) < 0) return UsageError("--frames must be >= 0");
  signal(SIGINT, OnInterrupt);
  signal(SIGTERM, OnInterrupt);
  const bool terminal = isatty(STDOUT_FILENO) == 1;
  auto stub = geotrain::v1::Status::NewStub(connection.channel);
  for (int frame = 1; !g_interrupted; ++frame) {
    const absl::Time started = absl::Now();
    geotrain::WatchViewOptions view;
    view.events = absl::GetFlag(FLAGS_events);
    view.title = absl::StrCat("geotrain watch ", address, "  ",
                              absl::FormatTime("%H:%M:%S", started, absl::LocalTimeZone()),
                              terminal ? "  (Ctrl-C to stop)" : "");
    if (winsize size{}; terminal && ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0) {
      view.max_width = size.ws_col;
    }
    geotrain::v1::ClusterStatus status;
    grpc::Status rpc = stub->GetClusterStatus(NewContext(connection).get(),
                                              geotrain::v1::ClusterStatusRequest(), &status);
    const std::string text =
        rpc.ok() ? geotrain::RenderWatchFrame(status, view)
                 : absl::StrCat(view.title, "\nstatus at ", address,
                                " failed: ", rpc.error_message(), " (trying again)\n");
    std::fputs(terminal ? "\x1b[H\x1b[2J" : (frame > 1 ? "\n" : ""), stdout);
    std::fputs(text.c_str(), stdout);
    std::fflush(stdout);
    if (absl::GetFlag(FLAGS_frames) > 0 && frame >= absl::GetFlag(FLAGS_frames)) break;
    const absl::Time next = started + interval;
    while (!g_interrupted && absl::Now() < next) absl::SleepFor(absl::Milliseconds(50));
  }
  return 0;
}

// `plan`: the planner's prediction for the current plan; with --explain,
// per stage: compute, link, bound and why each worker is where it is.
int PrintPlan(const geotrain::v1::ClusterStatus& status) {
  if (status.state() == "waiting" || !status.has_prediction()) {
    std::printf("no plan yet (%s)\n", status.state().c_str());
    return 0;
  }
  const geotrain::v1::PlanPrediction& p = status.prediction();
  std::printf("planner %s%s, epoch %llu: predicted %.3f ms per sample, T* %.2f ms per microbatch "
              "(bound: %s), W %d; measured %.1f samples/s",
              p.planner().c_str(), p.exact() ? " (optimal)" : "",
              static_cast<unsigned long long>(status.epoch()), 1e3 * p.time_per_sample_s(),
              1e3 * p.bottleneck_s(), p.bound().c_str(), p.in_flight(), status.samples_per_s());
  if (status.samples_per_s() > 0 && p.time_per_sample_s() > 0) {
    std::printf(" (%.0f%% of the predicted %.1f)", 100 * status.samples_per_s() *
                                                       p.time_per_sample_s(),
                1 / p.time_per_sample_s());
  }
  std::printf("\n");
  if (p.candidates() > 0) {
    std::printf("planned in %.3f s from %d workers\n", p.planning_s(), p.candidates());
  }
  if (absl::GetFlag(FLAGS_explain)) std::printf("%s", p.explanation().c_str());
  return 0;
}

// `network`: the coordinator's link matrix, one ordered pair a line.
int PrintNetwork(const geotrain::v1::ClusterStatus& status) {
  std::map<std::string, std::string> names;
  for (const auto& w : status.workers()) names[w.id()] = w.name();
  auto name = [&](const std::string& id) {
    auto it = names.find(id);
    return it == names.end() || it->second.empty() ? id : it->second;
  };
  std::printf("%-16s %-16s %10s %12s %8s %s\n", "FROM", "TO", "RTT ms", "RATE Mb/s", "AGE s",
              "SOURCE");
  for (const auto& link : status.network()) {
    const std::string rtt =
        link.rtt_s() > 0 ? absl::StrFormat("%.2f", 1e3 * link.rtt_s()) : std::string("-");
    const std::string rate =
        link.rate_bps() > 0 ? absl::StrFormat("%.1f", link.rate_bps() / 1e6) : std::string("-");
    std::printf("%-16s %-16s %10s %12s %8.0f %s\n", name(link.from_worker()).c_str(),
                name(link.to_worker()).c_str(), rtt.c_str(), rate.c_str(), link.age_s(),
                link.rate_bps() > 0 || link.rtt_s() > 0 ? link.source().c_str()
                                                        : "probe failed");
  }
  if (status.network_size() == 0) std::printf("(nothing measured yet)\n");
  // Each worker's port, which all of its links share.
  bool header = false;
  for (const auto& w : status.workers()) {
    if (w.uplink_bps() <= 0 && w.downlink_bps() <= 0) continue;
    if (!header) std::printf("\n%-16s %12s %12s\n", "ACCESS LINK", "UP Mb/s", "DOWN Mb/s");
    header = true;
    std::printf("%-16s %12.1f %12.1f\n", name(w.id()).c_str(), w.uplink_bps() / 1e6,
                w.downlink_bps() / 1e6);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  const std::vector<char*> raw_args = absl::ParseCommandLine(argc, argv);
  const std::vector<std::string> args(raw_args.begin(), raw_args.end());
  const bool known =
      (args.size() == 2 && (args[1] == "status" || args[1] == "plan" || args[1] == "network" ||
                            args[1] == "export" || args[1] == "health" ||
                            args[1] == "watch")) ||
                     (args.size() >= 3 && (args[1] == "token" || args[1] == "worker"));
  if (!known) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  if (absl::GetFlag(FLAGS_timeout_ms) <= 0) return UsageError("--timeout_ms must be > 0");
  const bool health = args[1] == "health";
  const std::string address = health && !absl::GetFlag(FLAGS_target).empty()
                                  ? absl::GetFlag(FLAGS_target)
                                  : absl::GetFlag(FLAGS_coordinator);
  if (absl::Status valid = geotrain::ValidateHostPort(
          health && !absl::GetFlag(FLAGS_target).empty() ? "target" : "coordinator", address,
          false);
      !valid.ok()) {
    return UsageError(std::string(valid.message()));
  }
  absl::StatusOr<Connection> connection = Connect(address);
  if (!connection.ok()) {
    Fail(std::string(connection.status().message()));
    return health ? 3 : 1;
  }
  if (health) return HealthCommand(*connection, address);
  if (args[1] == "token") return TokenCommand(args, *connection, address);
  if (args[1] == "worker") return WorkerCommand(args, *connection, address);
  if (args[1] == "export") return ExportCommand(*connection, address);
  if (args[1] == "watch") return WatchCommand(*connection, address);
  auto stub = geotrain::v1::Status::NewStub(connection->channel);
  geotrain::v1::ClusterStatus status;
  geotrain::v1::ClusterStatusRequest request;
  if (args[1] == "status") {
    const bool table = !absl::GetFlag(FLAGS_json) && !absl::GetFlag(FLAGS_brief);
    const int page_size = absl::GetFlag(FLAGS_page_size);
    request.set_page_size(page_size >= 0 ? page_size : table ? 50 : 0);
    request.set_page_token(absl::GetFlag(FLAGS_page_token));
    geotrain::v1::WorkerFilter* filter = request.mutable_filter();
    filter->set_state(absl::GetFlag(FLAGS_state));
    if (absl::GetFlag(FLAGS_stage) >= 0) filter->set_stage(absl::GetFlag(FLAGS_stage));
    if (absl::GetFlag(FLAGS_pipeline) >= 0) filter->set_pipeline(absl::GetFlag(FLAGS_pipeline));
    filter->set_name_contains(absl::GetFlag(FLAGS_name));
  }
  grpc::Status rpc = stub->GetClusterStatus(NewContext(*connection).get(), request, &status);
  if (!rpc.ok()) return RpcFailed("status", address, rpc);
  if (args[1] == "plan") return PrintPlan(status);
  if (args[1] == "network") return PrintNetwork(status);
  if (absl::GetFlag(FLAGS_json)) {
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    options.always_print_primitive_fields = true;
    google::protobuf::util::MessageToJsonString(status, &json, options);
    std::printf("%s\n", json.c_str());
  } else if (absl::GetFlag(FLAGS_brief)) {
    PrintBrief(status);
  } else {
    PrintTable(status);
  }
  return 0;
}
