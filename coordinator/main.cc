// geotrain-coordinator: admits workers, plans the pipeline, publishes plans,
// records progress. See README.md for the flags.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/job_spec.h"
#include "common/logging.h"
#include "common/rpc_options.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/job_controller.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7070", "HOST:PORT to serve on (port 0: any)");
ABSL_FLAG(std::string, job, "", "job spec (.textproto), required");
ABSL_FLAG(std::string, state_dir, "geotrain-state", "directory for durable state");
ABSL_FLAG(std::string, metrics_log, "", "JSON-lines metrics file (default: <state_dir>/metrics.jsonl)");
ABSL_FLAG(int, min_workers, 0, "override the job's min_workers");
ABSL_FLAG(int, steps, 0, "override the job's steps");
ABSL_FLAG(std::string, schedule, "", "override the job's schedule (sync)");
ABSL_FLAG(int64_t, seed, -1, "override the job's seed");
ABSL_FLAG(std::string, activation_codec, "", "override the job's activation codec (none, fp16, bf16, int8, int4, topk)");
ABSL_FLAG(std::string, gradient_codec, "", "override the job's gradient codec");
ABSL_FLAG(bool, adaptive, false,
          "adaptive compression: each link steps between none and its direction's codec "
          "(the strongest allowed) as the link or the compute limits it");
ABSL_FLAG(std::string, port_file, "", "write the bound port here once serving");
ABSL_FLAG(bool, exit_when_done, false, "exit once the job has finished");

namespace {
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

int Fail(const std::string& message) {
  std::fprintf(stderr, "geotrain-coordinator: %s\n", message.c_str());
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "geotrain-coordinator --listen=HOST:PORT --job=FILE [--state_dir=DIR] "
      "[--metrics_log=FILE]");
  absl::ParseCommandLine(argc, argv);
  geotrain::SetLogPrefix("coordinator");

  const std::string job_path = absl::GetFlag(FLAGS_job);
  if (job_path.empty()) return Fail("--job=FILE is required");
  absl::StatusOr<geotrain::v1::JobSpec> job = geotrain::LoadJobSpec(job_path);
  if (!job.ok()) return Fail(std::string(job.status().message()));
  if (absl::GetFlag(FLAGS_min_workers) > 0) {
    job->set_min_workers(absl::GetFlag(FLAGS_min_workers));
  }
  if (absl::GetFlag(FLAGS_steps) > 0) job->set_steps(absl::GetFlag(FLAGS_steps));
  if (absl::GetFlag(FLAGS_seed) >= 0) {
    job->set_seed(static_cast<uint64_t>(absl::GetFlag(FLAGS_seed)));
  }
  if (!absl::GetFlag(FLAGS_schedule).empty()) {
    absl::StatusOr<geotrain::v1::Schedule> schedule =
        geotrain::ParseSchedule(absl::GetFlag(FLAGS_schedule));
    if (!schedule.ok()) return Fail(std::string(schedule.status().message()));
    job->set_schedule(*schedule);
  }
  for (auto [flag, setter] :
       {std::pair{absl::GetFlag(FLAGS_activation_codec), &geotrain::v1::JobSpec::set_activation_codec},
        std::pair{absl::GetFlag(FLAGS_gradient_codec), &geotrain::v1::JobSpec::set_gradient_codec}}) {
    if (flag.empty()) continue;
    absl::StatusOr<geotrain::v1::Codec> codec = geotrain::ParseCodecName(flag);
    if (!codec.ok()) return Fail(std::string(codec.status().message()));
    ((*job).*setter)(*codec);
  }
  if (absl::GetFlag(FLAGS_adaptive)) job->set_adaptive(true);
  if (absl::Status valid = geotrain::ValidateJobSpec(*job); !valid.ok()) {
    return Fail(absl::StrCat(job_path, " with flag overrides: ", valid.message()));
  }

  geotrain::SteadyClock clock;
  geotrain::JobControllerOptions options;
  options.job = *job;
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.metrics_log_path = absl::GetFlag(FLAGS_metrics_log).empty()
                                 ? options.state_dir + "/metrics.jsonl"
                                 : absl::GetFlag(FLAGS_metrics_log);
  options.clock = &clock;
  options.heartbeat_ms = std::max(100, job->lease_ms() / 5);
  auto controller = geotrain::JobController::Create(options);
  if (!controller.ok()) return Fail(std::string(controller.status().message()));

  geotrain::CoordinatorService coordinator_service(controller->get());
  geotrain::StatusService status_service(controller->get());
  grpc::ServerBuilder builder;
  geotrain::ConfigureServerBuilder(&builder);
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen),
                           grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&coordinator_service);
  builder.RegisterService(&status_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_listen)));
  }
  GT_LOG(Info) << "listening on port " << port << " (" << absl::GetFlag(FLAGS_listen)
               << "), job " << job->name() << ", waiting for "
               << job->min_workers() << " worker(s)";
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_port_file)) << port << "\n";
  }

  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  while (!g_stop) {
    (*controller)->Tick();
    if (absl::GetFlag(FLAGS_exit_when_done) && (*controller)->done()) {
      // Give workers a moment to read the final plan before closing.
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  GT_LOG(Info) << "shutting down";
  (*controller)->Shutdown();
  server->Shutdown(geotrain::DeadlineFromNow(std::chrono::milliseconds(2000)));
  return 0;
}
