#include "relay/relay_daemon.h"

#include <unistd.h>

#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/rpc_options.h"
#include "common/status_macros.h"
#include "worker/worker_credentials.h"

namespace geotrain {

RelayDaemon::RelayDaemon(RelayDaemonOptions options)
    : options_(std::move(options)), coordinator_(options_.coordinator) {}

RelayDaemon::~RelayDaemon() { Stop(); }

void RelayDaemon::Stop() {
  stop_ = true;
  absl::MutexLock lock(&mu_);
  if (relay_ != nullptr) relay_->Shutdown();
  if (watch_context_) watch_context_->TryCancel();
}

absl::Status RelayDaemon::Join() {
  v1::JoinRequest join;
  join.set_name(options_.name);
  join.set_address(advertise_);
  join.set_role(v1::MEMBER_ROLE_RELAY);
  ASSIGN_OR_RETURN(v1::JoinResponse joined,
                   coordinator_.JoinWithRetry(join, stop_, options_.join_timeout));
  const std::string known = id();
  if (!known.empty() && !options_.insecure && joined.worker_id() != known) {
    return absl::InternalError(absl::StrCat("joined as ", joined.worker_id(),
                                            " with the certificate of ", known));
  }
  {
    absl::MutexLock lock(&mu_);
    id_ = joined.worker_id();
    relay_->SetIdentity(id_);
  }
  const v1::Reachability& reach = joined.reachability();
  if (reach.known() && !reach.reachable()) {
    // A relay nobody can dial is no use: say so loudly, but stay (the
    // operator may be fixing the port forward right now).
    GT_LOG(Error) << "this relay is not reachable at " << advertise_ << ": " << reach.detail();
  } else if (reach.known()) {
    GT_LOG(Info) << "reachable: " << reach.detail();
  }
  GT_LOG(Info) << "joined " << coordinator_.address() << " as relay " << id();
  return absl::OkStatus();
}

void RelayDaemon::HeartbeatLoop(int interval_ms) {
  while (!stop_) {
    absl::StatusOr<bool> known = coordinator_.Heartbeat(0, v1::StageStats());
    if (!known.ok() && (known.status().code() == absl::StatusCode::kPermissionDenied ||
                        known.status().code() == absl::StatusCode::kUnauthenticated)) {
      GT_LOG(Error) << "the coordinator refuses this relay: " << known.status().message();
      Stop();
      return;
    }
    if (known.ok() && !*known) {
      GT_LOG(Warning) << "the coordinator no longer knows this relay; joining again";
      if (absl::Status joined = Join(); !joined.ok()) {
        GT_LOG(Error) << "rejoin failed: " << joined.message();
      }
    }
    absl::SleepFor(absl::Milliseconds(interval_ms));
  }
}

absl::Status RelayDaemon::Run() {
  SpliceRelayOptions splice = options_.splice;
  splice.listen = options_.listen;
  ASSIGN_OR_RETURN(std::unique_ptr<SpliceRelay> relay, SpliceRelay::Start(splice));
  SpliceRelay* const splicer = relay.get();  // lives until this object goes
  {
    absl::MutexLock lock(&mu_);
    relay_ = std::move(relay);
  }
  if (stop_) splicer->Shutdown();
  if (options_.insecure) {
    GT_LOG(Warning) << "--insecure: links through this relay are plaintext";
  } else {
    WorkerCredentialOptions credential_options;
    credential_options.coordinator = options_.coordinator;
    credential_options.token = options_.token;
    credential_options.state_dir = options_.state_dir;
    credential_options.name = options_.name;
    credential_options.coordinator_server_name = options_.tls_server_name;
    ASSIGN_OR_RETURN(WorkerCredentials credentials,
                     ObtainWorkerCredentials(credential_options, stop_, options_.join_timeout));
    {
      absl::MutexLock lock(&mu_);
      id_ = credentials.worker_id;
    }
    coordinator_.UseSecurity(credentials.coordinator, options_.tls_server_name);
  }
  // HOST or HOST:PORT; the port defaults to the one listened on.
  std::string host = options_.listen.substr(0, options_.listen.rfind(':'));
  std::string port = std::to_string(splicer->port());
  if (!options_.advertise.empty()) {
    const size_t colon = options_.advertise.rfind(':');
    const bool has_port = colon != std::string::npos && options_.advertise.back() != ']';
    host = has_port ? options_.advertise.substr(0, colon) : options_.advertise;
    if (has_port) port = options_.advertise.substr(colon + 1);
  } else if (host == "0.0.0.0" || host.empty()) {
    char hostname[256] = {0};
    gethostname(hostname, sizeof(hostname) - 1);
    host = hostname;
  }
  advertise_ = absl::StrCat(host, ":", port);
  GT_LOG(Info) << "relay listening on port " << splicer->port() << ", advertised as " << advertise_;
  RETURN_IF_ERROR(Join());
  std::thread heartbeat([this] { HeartbeatLoop(1000); });
  absl::Status result = absl::CancelledError("stopped");
  uint64_t last_epoch = 0;
  while (!stop_) {
    auto context = std::make_unique<grpc::ClientContext>();
    grpc::ClientContext* raw = context.get();
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
      watch_context_ = std::move(context);
    }
    std::unique_ptr<grpc::ClientReader<v1::Plan>> reader = coordinator_.WatchPlan(raw);
    v1::Plan plan;
    bool done = false;
    while (reader->Read(&plan)) {
      if (plan.epoch() <= last_epoch) continue;
      last_epoch = plan.epoch();
      done = plan.job_done();
      std::map<std::string, SpliceRelay::Proofs> mine;
      const std::string self = id();
      for (const v1::PlannedLink& link : plan.links()) {
        if (link.dialer() == v1::LINK_DIALER_RELAY && link.relay_worker() == self) {
          mine[link.rendezvous()] = {link.upstream_proof(), link.downstream_proof()};
        }
      }
      GT_LOG(Info) << "plan epoch " << plan.epoch() << ": " << mine.size()
                   << " link(s) through this relay";
      splicer->SetLinks(std::move(mine));
    }
    const grpc::Status status = reader->Finish();
    if (done) {
      result = absl::OkStatus();
      break;
    }
    if (!stop_) {
      // Jittered: relays and workers whose coordinator restarted do not
      // all return in the same instant.
      const absl::Duration wait = Jittered(absl::Seconds(1));
      GT_LOG(Warning) << "plan watch ended (" << status.error_message() << "); reconnecting in "
                      << absl::FormatDuration(absl::Trunc(wait, absl::Milliseconds(1)));
      absl::SleepFor(wait);
    }
  }
  const SpliceRelayStats stats = splicer->stats();
  GT_LOG(Info) << "relay done: " << stats.pairs_total << " link(s) spliced, "
               << stats.bytes_spliced << " bytes, " << stats.refused << " refused";
  if (result.ok()) coordinator_.Leave();
  stop_ = true;
  splicer->Shutdown();
  heartbeat.join();
  return result;
}

}  // namespace geotrain
