// geotrain-ctl: the status CLI.
//   geotrain-ctl status --coordinator=HOST:PORT [--json] [--timeout_ms=N]
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "common/rpc_options.h"
#include "geotrain/v1/status.grpc.pb.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "coordinator HOST:PORT");
ABSL_FLAG(bool, json, false, "print the status as JSON");
ABSL_FLAG(bool, brief, false, "print one line: state, step, loss, samples/s");
ABSL_FLAG(int, timeout_ms, 3000, "deadline of the status call");
ABSL_FLAG(int, events, 8, "how many recent events to show (table only)");

namespace {

std::string StateName(geotrain::v1::WorkerState state) {
  std::string name = geotrain::v1::WorkerState_Name(state);
  const std::string prefix = "WORKER_STATE_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  for (char& c : name) c = static_cast<char>(std::tolower(c));
  return name;
}

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

void PrintTable(const geotrain::v1::ClusterStatus& s) {
  std::printf("job %s  state %s  schedule %s  epoch %lu\n", s.job().c_str(),
              s.state().c_str(), s.schedule().c_str(),
              static_cast<unsigned long>(s.epoch()));
  std::printf("step %d/%d  loss %.4f  samples %ld  samples/s %.1f  elapsed %.0fs",
              s.step(), s.steps(), s.loss(), static_cast<long>(s.samples()),
              s.samples_per_s(), s.elapsed_s());
  if (s.val_loss() > 0) std::printf("  val_loss %.4f", s.val_loss());
  if (s.accuracy() > 0) std::printf("  accuracy %.4f", s.accuracy());
  std::printf("\n\n%-4s %-12s %-22s %-7s %8s %5s %-8s %-9s %6s %8s %5s\n", "ID",
              "NAME", "ADDRESS", "DEVICE", "GFLOP/s", "STAGE", "LAYERS",
              "STATE", "HB_AGE", "RSS_MiB", "STEP");
  for (const auto& w : s.workers()) {
    std::string layers =
        w.stage() >= 0 ? absl::StrFormat("[%d,%d)", w.layer_begin(), w.layer_end())
                       : "-";
    // A replica shows as STAGE.K (K > 0); the primary as the stage alone.
    std::string stage = w.stage() < 0     ? "-"
                         : w.replica() > 0 ? absl::StrFormat("%d.%d", w.stage(), w.replica())
                                           : std::to_string(w.stage());
    std::printf("%-4s %-12s %-22s %-7s %8.1f %5s %-8s %-9s %5.1fs %8.1f %5d\n",
                w.id().c_str(), w.name().c_str(), w.address().c_str(),
                w.device().c_str(), w.gflops(), stage.c_str(), layers.c_str(),
                StateName(w.state()).c_str(), w.heartbeat_age_s(),
                w.rss_bytes() / 1048576.0, w.step());
  }
  std::printf("\n%-4s %-7s %7s %9s  %s\n", "ID", "DEVICE", "THREADS", "MEM_GiB", "BLAS");
  for (const auto& w : s.workers()) {
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

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "geotrain-ctl status --coordinator=HOST:PORT [--json | --brief]");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2 || std::string(args[1]) != "status") {
    std::fprintf(stderr, "usage: geotrain-ctl status --coordinator=HOST:PORT [--json | --brief]\n");
    return 2;
  }
  const std::string address = absl::GetFlag(FLAGS_coordinator);
  auto stub = geotrain::v1::Status::NewStub(geotrain::MakeChannel(address));
  grpc::ClientContext context;
  context.set_deadline(geotrain::DeadlineFromNow(
      std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms))));
  geotrain::v1::ClusterStatus status;
  grpc::Status rpc = stub->GetClusterStatus(
      &context, geotrain::v1::ClusterStatusRequest(), &status);
  if (!rpc.ok()) {
    std::fprintf(stderr, "geotrain-ctl: cannot get status from %s: %s (%s)\n",
                 address.c_str(), rpc.error_message().c_str(),
                 rpc.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                     ? "deadline exceeded: is the coordinator running?"
                     : "rpc failed");
    return 1;
  }
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
