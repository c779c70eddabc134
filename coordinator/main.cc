// geotrain-coordinator: admits workers, plans the pipeline, publishes plans,
// records progress. See README.md for the flags.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <vector>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/codec.h"
#include "common/health_reporter.h"
#include "common/http_server.h"
#include "common/job_spec.h"
#include "common/logging.h"
#include "common/metrics_exporter.h"
#include "common/rpc_options.h"
#include "common/transport_security.h"
#include "coordinator/access_store.h"
#include "coordinator/cluster_metrics.h"
#include "coordinator/cluster_authority.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/job_controller.h"
#include "coordinator/model_export.h"
#include "coordinator/plan_builder.h"
#include "coordinator/status_page.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7070", "HOST:PORT to serve on (port 0: any)");
ABSL_FLAG(std::string, job, "", "job spec (.textproto), required");
ABSL_FLAG(std::string, state_dir, "geotrain-state", "directory for durable state");
ABSL_FLAG(std::string, metrics_log, "", "JSON-lines metrics file (default: <state_dir>/metrics.jsonl)");
ABSL_FLAG(std::string, tensorboard_dir, "",
          "write TensorBoard event files here (loss, validation, samples/s, learning rate, "
          "per-stage and per-link curves); empty: none");
ABSL_FLAG(std::optional<int>, min_workers, std::nullopt, "override the job's min_workers");
ABSL_FLAG(std::optional<int>, steps, std::nullopt, "override the job's steps");
ABSL_FLAG(std::string, schedule, "", "override the job's schedule (sync)");
ABSL_FLAG(std::optional<int64_t>, seed, std::nullopt, "override the job's seed (>= 0)");
ABSL_FLAG(std::optional<int>, in_flight, std::nullopt,
          "override the job's in_flight: microbatches in flight under the async schedules "
          "(0: the planner's choice)");
ABSL_FLAG(std::optional<int>, update_every, std::nullopt,
          "override the job's update_every: backwards per update under async-stash");
ABSL_FLAG(std::optional<int>, max_stages, std::nullopt,
          "override the job's max_stages: at most this many pipeline stages (0: one per worker)");
ABSL_FLAG(std::string, activation_codec, "", "override the job's activation codec (none, fp16, bf16, int8, int4, topk)");
ABSL_FLAG(std::string, gradient_codec, "", "override the job's gradient codec");
ABSL_FLAG(bool, adaptive, false,
          "adaptive compression: each link steps between none and its direction's codec "
          "(the strongest allowed) as the link or the compute limits it");
ABSL_FLAG(std::string, port_file, "", "write the bound port here once serving");
ABSL_FLAG(std::string, health_listen, "",
          "HOST:PORT serving only the gRPC health service (and reflection) in plaintext, for "
          "probes without TLS (Kubernetes grpc probes); empty: off");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT serving Prometheus /metrics over plain HTTP without credentials "
          "(keep it on a private address); empty: off");
ABSL_FLAG(std::string, http_listen, "",
          "HOST:PORT serving the live status page at / (and its JSON at /status.json, and "
          "/metrics) over plain HTTP; with TLS on, all but the page itself need a viewer "
          "token (the page takes it from #token=...); empty: off");
ABSL_FLAG(bool, exit_when_done, false, "exit once the job has finished");
ABSL_FLAG(absl::Duration, probe_timeout, absl::Seconds(2),
          "how long the coordinator tries to dial a joiner's advertised address back "
          "(its reachability decides who dials each link); 0 turns probes off (every member "
          "is taken as reachable)");
ABSL_FLAG(absl::Duration, straggler_patience, absl::Seconds(5),
          "how long a stage must run far slower than the others and than its worker's own "
          "best pace before that worker is swapped for a standby; inf: never (a shared host "
          "whose load comes and goes)");
ABSL_FLAG(bool, insecure, false,
          "plaintext and no authentication on every call (loopback demos and tests only)");
ABSL_FLAG(std::string, tls_cert, "", "serving certificate (PEM) instead of the generated one");
ABSL_FLAG(std::string, tls_key, "", "its private key (PEM)");
ABSL_FLAG(std::string, tls_ca, "", "the CA that issued --tls_cert (PEM); tokens pin it");
ABSL_FLAG(std::vector<std::string>, tls_san, {},
          "extra DNS names or IP addresses for the generated serving certificate");
ABSL_FLAG(std::string, planner, "network",
          "network (the default): pipelines, workers, order, cuts and codecs chosen by the "
          "predicted samples/s on the measured links and ports (see geotrain-ctl plan "
          "--explain); join-order: stages in join order, cuts by compute (planner v1)");
ABSL_FLAG(std::string, export_dir, "",
          "when the job ends, write the newest complete model here (Hugging Face "
          "safetensors + config.json)");
ABSL_FLAG(int, joins_per_minute, 60, "joins and enrollments accepted per source host per minute");
ABSL_FLAG(int, anonymous_calls_per_host, 4,
          "calls without a client certificate (enrollments, status with a viewer token) in "
          "flight per source host; 32 in flight in all, whatever this says");

namespace {
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

int Fail(const std::string& message) {
  std::fprintf(stderr, "geotrain-coordinator: %s\n", message.c_str());
  return 2;
}

// --export_dir at the job's end: the newest complete model from the
// checkpoints on disk; the outcome is an event either way.
void ExportAtEnd(const geotrain::v1::JobSpec& job, const std::string& state_dir,
                 const std::string& out_dir, geotrain::JobController* controller) {
  absl::StatusOr<std::unique_ptr<geotrain::CheckpointStore>> store =
      geotrain::CheckpointStore::Open(state_dir);
  absl::StatusOr<geotrain::ModelExport> exported =
      store.ok() ? geotrain::ExportModel(job, **store, {out_dir}) : store.status();
  if (!exported.ok()) {
    GT_LOG(Warning) << "export to " << out_dir << " failed: " << exported.status().message();
    controller->RecordAdminEvent("export_failed",
                                 absl::StrCat(out_dir, ": ", exported.status().message()));
    return;
  }
  const std::string detail =
      absl::StrCat(exported->parameters, " parameters of step ", exported->step, " to ", out_dir,
                   " (", absl::StrJoin(exported->files, ", "), ")");
  GT_LOG(Info) << "exported " << detail;
  controller->RecordAdminEvent("exported", detail);
}
}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "geotrain-coordinator --listen=HOST:PORT --job=FILE [--state_dir=DIR] "
      "[--metrics_log=FILE]");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  geotrain::SetLogPrefix("coordinator");
  // Debian's abseil checks lock order on every acquisition, in one global
  // graph (7% of the coordinator's CPU at 10,000 workers). The unit tests,
  // which link the same locks, keep the check.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (positional.size() > 1) {
    return Fail(std::string("unexpected argument '") + positional[1] + "' (flags are --name=value)");
  }
  if (absl::Status listen = geotrain::ValidateHostPort("listen", absl::GetFlag(FLAGS_listen), true);
      !listen.ok()) {
    return Fail(std::string(listen.message()));
  }
  if (absl::GetFlag(FLAGS_joins_per_minute) < 1) return Fail("--joins_per_minute must be >= 1");
  if (absl::GetFlag(FLAGS_anonymous_calls_per_host) < 1) {
    return Fail("--anonymous_calls_per_host must be >= 1");
  }
  if (absl::StatusOr<std::unique_ptr<geotrain::Planner>> planner =
          geotrain::MakePlannerByName(absl::GetFlag(FLAGS_planner));
      !planner.ok()) {
    return Fail(absl::StrCat("--planner: ", planner.status().message()));
  }

  const std::string job_path = absl::GetFlag(FLAGS_job);
  if (job_path.empty()) return Fail("--job=FILE is required");
  absl::StatusOr<geotrain::v1::JobSpec> job = geotrain::LoadJobSpec(job_path);
  if (!job.ok()) return Fail(std::string(job.status().message()));
  if (std::optional<int> min_workers = absl::GetFlag(FLAGS_min_workers)) {
    if (*min_workers < 1) return Fail("--min_workers must be >= 1");
    job->set_min_workers(*min_workers);
  }
  if (std::optional<int> steps = absl::GetFlag(FLAGS_steps)) {
    if (*steps < 1) return Fail("--steps must be >= 1");
    job->set_steps(*steps);
  }
  if (std::optional<int64_t> seed = absl::GetFlag(FLAGS_seed)) {
    if (*seed < 0) return Fail("--seed must be >= 0");
    job->set_seed(static_cast<uint64_t>(*seed));
  }
  if (!absl::GetFlag(FLAGS_schedule).empty()) {
    absl::StatusOr<geotrain::v1::Schedule> schedule =
        geotrain::ParseSchedule(absl::GetFlag(FLAGS_schedule));
    if (!schedule.ok()) return Fail(std::string(schedule.status().message()));
    job->set_schedule(*schedule);
  }
  // Ranges are checked with the rest of the job (ValidateJobSpec below).
  if (std::optional<int> in_flight = absl::GetFlag(FLAGS_in_flight)) job->set_in_flight(*in_flight);
  if (std::optional<int> update_every = absl::GetFlag(FLAGS_update_every)) {
    job->set_update_every(*update_every);
  }
  if (std::optional<int> max_stages = absl::GetFlag(FLAGS_max_stages)) {
    job->set_max_stages(*max_stages);
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
  options.tensorboard_dir = absl::GetFlag(FLAGS_tensorboard_dir);
  options.clock = &clock;
  options.heartbeat_ms = std::max(100, job->lease_ms() / 5);
  const bool insecure = absl::GetFlag(FLAGS_insecure);
  options.authenticated_callers = !insecure;
  options.planner = absl::GetFlag(FLAGS_planner);
  const absl::Duration straggler_patience = absl::GetFlag(FLAGS_straggler_patience);
  if (straggler_patience < absl::Milliseconds(100)) {
    return Fail("--straggler_patience: at least 100ms (one figure is no trend); inf: never");
  }
  options.stragglers.patience_ms = straggler_patience == absl::InfiniteDuration()
                                       ? std::numeric_limits<int64_t>::max()
                                       : absl::ToInt64Milliseconds(straggler_patience);

  // TLS: the cluster CA and the tokens live in the state dir.
  std::unique_ptr<geotrain::ClusterAuthority> authority;
  std::unique_ptr<geotrain::AccessStore> access;
  geotrain::TransportSecurity server_security = geotrain::TransportSecurity::Insecure();
  if (insecure) {
    GT_LOG(Warning) << "--insecure: every call is plaintext and unauthenticated; anyone who "
                       "can reach this port can join, report and evict. Loopback demos and "
                       "tests only.";
  } else {
    geotrain::ClusterAuthorityOptions tls;
    tls.dir = options.state_dir + "/tls";
    tls.serving_certificate_path = absl::GetFlag(FLAGS_tls_cert);
    tls.serving_key_path = absl::GetFlag(FLAGS_tls_key);
    tls.serving_ca_path = absl::GetFlag(FLAGS_tls_ca);
    tls.extra_names = absl::GetFlag(FLAGS_tls_san);
    absl::StatusOr<std::unique_ptr<geotrain::ClusterAuthority>> opened =
        geotrain::ClusterAuthority::Open(tls);
    if (!opened.ok()) return Fail(absl::StrCat("TLS: ", opened.status().message()));
    authority = *std::move(opened);
    absl::StatusOr<std::unique_ptr<geotrain::AccessStore>> tokens = geotrain::AccessStore::Open(
        options.state_dir + "/access.textproto", authority->serving_ca_fingerprint());
    if (!tokens.ok()) return Fail(std::string(tokens.status().message()));
    access = *std::move(tokens);
    server_security = authority->server_security();
    GT_LOG(Info) << "TLS on; CA " << authority->serving_ca_fingerprint() << "; admin credential "
                 << authority->admin_credential_path();
  }
  if (access != nullptr) {
    // A spot check's confirmed mismatch denies the worker's certificate.
    options.revoke_identity = [store = access.get()](const std::string& worker_id) {
      return store->RevokeWorker(worker_id);
    };
  }
  auto controller = geotrain::JobController::Create(options);
  if (!controller.ok()) return Fail(std::string(controller.status().message()));
  if (!job->init_from().empty()) {
    absl::StatusOr<geotrain::ModelImport> imported =
        geotrain::ImportModel(*job, (*controller)->checkpoints());
    if (!imported.ok()) {
      return Fail(absl::StrCat("init_from: ", imported.status().message()));
    }
    const std::string detail =
        imported->layers == 0
            ? absl::StrCat(job->init_from(), " not imported: the state dir has checkpoints "
                           "already (the job resumes from them)")
            : absl::StrCat(imported->layers, " layers (", imported->parameters,
                           " parameters) from ", job->init_from(), " as step 0");
    GT_LOG(Info) << "init_from: " << detail;
    (*controller)->RecordAdminEvent("imported", detail);
  }

  std::unique_ptr<geotrain::MetricsExporter> metrics;
  if (const std::string listen = absl::GetFlag(FLAGS_metrics_listen); !listen.empty()) {
    if (absl::Status valid = geotrain::ValidateHostPort("metrics_listen", listen, true);
        !valid.ok()) {
      return Fail(std::string(valid.message()));
    }
    geotrain::JobController* job_controller = controller->get();
    absl::StatusOr<std::unique_ptr<geotrain::MetricsExporter>> started =
        geotrain::MetricsExporter::Start(
            listen, [job_controller] { return geotrain::ClusterMetrics(job_controller->Status()); });
    if (!started.ok()) return Fail(std::string(started.status().message()));
    metrics = *std::move(started);
  }

  geotrain::CoordinatorServiceOptions service_options;
  service_options.controller = controller->get();
  service_options.authority = authority.get();
  service_options.access = access.get();
  service_options.clock = &clock;
  service_options.joins_per_source_per_minute = absl::GetFlag(FLAGS_joins_per_minute);
  service_options.anonymous_calls_per_source = absl::GetFlag(FLAGS_anonymous_calls_per_host);
  geotrain::ReachabilityProberOptions probe_options;
  probe_options.security = server_security;
  probe_options.deadline = absl::GetFlag(FLAGS_probe_timeout);
  probe_options.enabled = probe_options.deadline > absl::ZeroDuration();
  if (probe_options.deadline > absl::Seconds(4)) {
    return Fail("--probe_timeout: at most 4s (a joiner's Join call waits for the probe)");
  }
  geotrain::ReachabilityProber prober(probe_options);
  service_options.prober = &prober;
  geotrain::CoordinatorService coordinator_service(service_options);
  geotrain::AdminService admin_service(service_options);
  geotrain::StatusService status_service(service_options);
  geotrain::AuditService audit_service(service_options);
  // Its state is recovered (JobController::Create) before the port opens;
  // health goes SERVING once the server is up and NOT_SERVING at shutdown.
  geotrain::HealthReporter health("geotrain.v1.Coordinator", "starting");
  geotrain::EnableStandardServices();
  grpc::ServerBuilder builder;
  geotrain::ConfigureServerBuilder(&builder);
  // Nothing a caller sends the coordinator is larger than a checkpoint
  // chunk (about 1 MiB), and gRPC buffers a message before any handler
  // checks who sent it: a small limit, and a memory quota for all calls,
  // bound what strangers can make it hold (issue 32: 64 calls of 15 MiB took
  // it from 58 to 798 MiB).
  builder.SetMaxReceiveMessageSize(geotrain::kCoordinatorMaxReceiveBytes);
  grpc::ResourceQuota quota("geotrain-coordinator");
  quota.Resize(geotrain::kCoordinatorMemoryQuotaBytes);
  quota.SetMaxThreads(geotrain::kCoordinatorMaxThreads);
  builder.SetResourceQuota(quota);
  int port = 0;
  builder.AddListeningPort(
      absl::GetFlag(FLAGS_listen),
      geotrain::MakeServerCredentials(server_security, geotrain::ClientCertificates::kOptional),
      &port);
  builder.RegisterService(&coordinator_service);
  coordinator_service.AttachAsyncMethods(&builder);
  builder.RegisterService(&admin_service);
  builder.RegisterService(&status_service);
  builder.RegisterService(&audit_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_listen)));
  }
  health.Attach(server.get());
  coordinator_service.StartAsyncMethods();
  std::unique_ptr<grpc::Server> health_server;
  if (const std::string listen = absl::GetFlag(FLAGS_health_listen); !listen.empty()) {
    if (absl::Status valid = geotrain::ValidateHostPort("health_listen", listen, true);
        !valid.ok()) {
      return Fail(std::string(valid.message()));
    }
    absl::StatusOr<std::unique_ptr<grpc::Server>> started = geotrain::StartHealthServer(listen);
    if (!started.ok()) return Fail(std::string(started.status().message()));
    health_server = *std::move(started);
    health.Attach(health_server.get());
  }
  health.Set(true, "state recovered, serving");
  std::unique_ptr<geotrain::HttpServer> status_page;
  if (const std::string listen = absl::GetFlag(FLAGS_http_listen); !listen.empty()) {
    if (absl::Status valid = geotrain::ValidateHostPort("http_listen", listen, true);
        !valid.ok()) {
      return Fail(std::string(valid.message()));
    }
    geotrain::StatusPageOptions page;
    page.listen = listen;
    page.controller = controller->get();
    page.access = access.get();
    page.security = access ? absl::StrCat("tls, CA ", authority->serving_ca_fingerprint())
                           : "insecure (plaintext, no authentication)";
    page.serving = [&health] { return health.serving(); };
    absl::StatusOr<std::unique_ptr<geotrain::HttpServer>> started =
        geotrain::StartStatusPage(page);
    if (!started.ok()) return Fail(std::string(started.status().message()));
    status_page = *std::move(started);
    const std::string host = listen.substr(0, listen.rfind(':'));
    GT_LOG(Info) << "status page: http://" << host << ":" << status_page->port() << "/"
                 << (access ? " (open it as /#token=<viewer token>; make one with "
                              "geotrain-ctl token create --role=viewer)"
                            : "");
  }
  GT_LOG(Info) << "listening on port " << port << " (" << absl::GetFlag(FLAGS_listen)
               << "), job " << job->name() << ", waiting for "
               << job->min_workers() << " worker(s)";
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_port_file)) << port << "\n";
  }

  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  bool exported = false;
  while (!g_stop) {
    (*controller)->Tick();
    if (!exported && (*controller)->done() && !absl::GetFlag(FLAGS_export_dir).empty()) {
      exported = true;
      ExportAtEnd(*job, options.state_dir, absl::GetFlag(FLAGS_export_dir), controller->get());
    }
    if (absl::GetFlag(FLAGS_exit_when_done) && (*controller)->done()) {
      // The final plan visible (durable), then a moment for the workers to
      // read it before closing.
      (*controller)->FlushState();
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  GT_LOG(Info) << "shutting down";
  health.ShutDown("shutting down");
  (*controller)->Shutdown();
  coordinator_service.EndAsyncMethods();
  server->Shutdown(geotrain::DeadlineFromNow(std::chrono::milliseconds(2000)));
  coordinator_service.StopAsyncMethods();
  health.DetachAll();
  if (health_server) health_server->Shutdown(geotrain::DeadlineFromNow(std::chrono::milliseconds(500)));
  return 0;
}
