#include "worker/training_session.h"

#include <algorithm>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/layer_state.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/link_validator.h"
#include "worker/outer_links.h"
#include "worker/replica_router.h"

namespace geotrain {
namespace {

std::string Addresses(const std::vector<StageWorker>& workers) {
  std::string joined;
  for (const StageWorker& w : workers) absl::StrAppend(&joined, joined.empty() ? "" : ",", w.address);
  return joined;
}

}  // namespace

TrainingSession::TrainingSession(const v1::JobSpec& job, ServedPlan plan, SessionParts parts,
                                 SessionOptions options)
    : job_(plan.PipelineJob(job)),
      plan_(std::move(plan)),
      parts_(parts),
      options_(std::move(options)),
      inbox_(std::make_shared<Inbox>(options_.inbox_capacity)),
      plan_epoch_(plan_.plan_epoch()) {}

TrainingSession::~TrainingSession() { Finish(); }

bool TrainingSession::Amend(const ServedPlan& next) {
  if (aborted_ || closing_ || !plan_.ContinuesIn(next)) return false;
  absl::MutexLock lock(&mu_);
  if (closing_) return false;
  pending_plan_ = next;
  plan_epoch_ = next.plan_epoch();
  return true;
}

void TrainingSession::Abort() {
  aborted_ = true;
  closing_ = true;
  inbox_->Close();
  {
    absl::MutexLock lock(&mu_);
    for (const std::shared_ptr<PipelineLink>& link : links_) link->EndOnPurpose();
  }
  parts_.links->Deactivate();
  if (parts_.replicas != nullptr) parts_.replicas->Deactivate();
  // Ends an exchange that waits for a peer of the old plan.
  if (parts_.tied != nullptr) parts_.tied->Deactivate();
}

void TrainingSession::Finish() {
  closing_ = true;
  inbox_->Close();
  for (std::thread& opener : openers_) opener.join();
  openers_.clear();
  std::vector<std::shared_ptr<PipelineLink>> links;
  {
    absl::MutexLock lock(&mu_);
    links.swap(links_);
    for (OpenedLink& opened : opened_) links.push_back(std::move(opened.link));
    opened_.clear();
  }
  // A reader keeps its end alive until the link ends.
  for (const std::shared_ptr<PipelineLink>& link : links) link->EndOnPurpose();
  // Its sends fail once the links have ended.
  outer_links_.reset();
  if (parts_.replicas != nullptr) parts_.replicas->Deactivate();
  if (parts_.tied != nullptr) parts_.tied->Deactivate();
}

absl::StatusOr<std::shared_ptr<PipelineLink>> TrainingSession::Open(
    const StageWorker& peer, PeerSide side, std::shared_ptr<const LinkValidator> validator) {
  return OpenIn(plan_, peer, side, std::move(validator), &aborted_, plan_.epoch());
}

absl::StatusOr<std::shared_ptr<PipelineLink>> TrainingSession::OpenIn(
    const ServedPlan& plan, const StageWorker& peer, PeerSide side,
    std::shared_ptr<const LinkValidator> validator, const std::atomic<bool>* stop,
    uint64_t report_epoch) {
  const bool upstream_end = plan.UpstreamEndOf(side);
  const v1::PlannedLink* planned = plan.LinkTo(peer, side);
  const v1::LinkDialer dialer =
      planned == nullptr || planned->dialer() == v1::LINK_DIALER_UNSPECIFIED
          ? v1::LINK_DIALER_UPSTREAM
          : planned->dialer();
  // The plan's upstream end dials, or its downstream end, or both a relay.
  const bool peer_dials = (dialer == v1::LINK_DIALER_UPSTREAM && !upstream_end) ||
                          (dialer == v1::LINK_DIALER_DOWNSTREAM && upstream_end);
  absl::StatusOr<std::shared_ptr<PipelineLink>> end;
  std::string accused = peer.id;
  if (dialer == v1::LINK_DIALER_NONE) {
    end = absl::FailedPreconditionError(
        absl::StrCat("no way to open the ", PeerSideName(side), " link to '", peer.id,
                     "': ", planned != nullptr ? planned->reason() : "the plan says so"));
  } else if (peer_dials && side == PeerSide::kUpstream) {
    return std::shared_ptr<PipelineLink>();  // it dials in
  } else if (peer_dials) {
    GT_LOG(Info) << "waiting for '" << peer.id << "' to dial in ("
                 << (planned != nullptr ? planned->reason() : "") << ")";
    end = parts_.links->AwaitDialIn(side, peer.id, stop);
  } else {
    if (dialer == v1::LINK_DIALER_RELAY) accused = planned->relay_worker();
    DialTarget target{plan.self_id(), plan.stage(), {peer.id, peer.address, side}, planned};
    end = parts_.links->Dial(target, std::move(validator), inbox_, stop);
  }
  if (!end.ok()) {
    // Reported like a broken link (naming its relay when it had one), or
    // nothing would ever re-plan around it.
    if (!*stop && dialer != v1::LINK_DIALER_NONE) {
      parts_.coordinator->ReportEventOfEpoch(
          report_epoch, "link_lost",
          absl::StrCat(PeerSideName(side), " link to ", peer.address,
                       " could not be opened: ", end.status().message()),
          accused);
    }
    GT_LOG(Error) << end.status().message();
    return end.status();
  }
  absl::MutexLock lock(&mu_);
  links_.push_back(*end);
  if (aborted_) (*end)->EndOnPurpose();
  return end;
}

void TrainingSession::ActivateReplicas() {
  ReplicaTarget target;
  target.epoch = plan_.epoch();
  target.stage = plan_.stage();
  target.layer_begin = plan_.assignment().layer_begin();
  target.layer_end = plan_.assignment().layer_end();
  target.self_id = plan_.self_id();
  target.max_layer_bytes = 0;
  for (int layer = target.layer_begin; layer < target.layer_end; ++layer) {
    target.max_layer_bytes = std::max(target.max_layer_bytes, MaxLayerWeightsBytes(job_, layer));
  }
  for (const StageWorker& w : plan_.stage_workers()) {
    if (w.id == plan_.self_id()) continue;
    auto route = options_.routes.find(w.address);
    target.peers.push_back({w.id, route == options_.routes.end() ? w.address : route->second});
  }
  GT_LOG(Info) << "stage " << plan_.stage() << " has " << plan_.stage_workers().size()
               << " workers; this one is " << (plan_.primary() ? "the primary" : "a replica");
  parts_.replicas->Activate(std::move(target));
}

absl::Status TrainingSession::StartOuterSync(StageRuntime* runtime,
                                             std::shared_ptr<const LinkValidator> validator) {
  const v1::OuterOptimizer& job_outer = job_.outer();
  if (!runtime->outer_started()) {
    // A fresh run: every replica holds the same initial weights (seeded
    // per layer), which become the first outer weights.
    StageRuntime::OuterSettings settings;
    settings.lr = job_outer.lr();
    settings.momentum = job_outer.momentum();
    settings.encoding.codec = job_outer.codec();
    settings.encoding.block_size = job_.codec_block_size();
    RETURN_IF_ERROR(runtime->StartOuter(settings));
  }
  std::map<int, std::shared_ptr<PipelineLink>> links;
  std::set<int> pipelines{plan_.pipeline()};
  for (const StageWorker& peer : plan_.outer_peers()) pipelines.insert(peer.pipeline);
  for (const StageWorker& peer : plan_.outer_link_peers()) {
    const uint64_t link_epoch = plan_.OuterLinkEpoch(peer);
    ASSIGN_OR_RETURN(std::shared_ptr<PipelineLink> link,
                     OpenIn(plan_, peer, PeerSide::kReplica, validator->ForReplicaLink(peer.id),
                            &aborted_, link_epoch));
    links[peer.pipeline] = std::move(link);
    outer_peers_[peer.id] = {peer.pipeline, link_epoch};
    wanted_outer_[peer.id] = link_epoch;
  }
  OuterSyncOptions o;
  o.epoch = plan_.epoch();
  o.stage = plan_.stage();
  o.stages = plan_.num_stages();
  o.inner_steps = job_outer.inner_steps();
  o.streaming = job_outer.streaming();
  o.start_step = plan_.start_step();
  o.final_step = job_.steps();
  for (const StageWorker& peer : plan_.outer_link_peers()) {
    o.link_epochs[peer.pipeline] = plan_.OuterLinkEpoch(peer);
  }
  // Two leases: as long as the coordinator gives a silent worker; and the
  // time a pseudo-gradient takes at the outer transfers' pace.
  o.deadline = std::max(absl::Seconds(10), absl::Milliseconds(2 * job_.lease_ms()));
  if (std::shared_ptr<SendPacer> pacer = parts_.outer_pacer) {
    o.transfer_time = [pacer](uint64_t bytes) {
      const double pace = pacer->bytes_per_s();
      return pace > 0 ? absl::Seconds(static_cast<double>(bytes) / pace) : absl::ZeroDuration();
    };
  }
  // A bound on the outer state a replica waits for at the start.
  o.state_bytes = runtime->StateBytes();
  // Every epoch: the replicas of a stage may have drifted (a re-plan cut a
  // round short, a standby took a place, a pipeline joined).
  o.share_state = true;
  outer_links_ = std::make_unique<OuterLinks>(std::move(links), plan_.stage(), parts_.outer_pacer);
  outer_compute_ = std::make_unique<RuntimeOuterCompute>(runtime);
  outer_sync_ = std::make_unique<OuterSync>(o, plan_.pipeline(), std::move(pipelines),
                                            outer_compute_.get(), outer_links_.get());
  RETURN_IF_ERROR(outer_sync_->Start(absl::Now()));
  GT_LOG(Info) << "outer sync of stage " << plan_.stage() << ": pipeline " << plan_.pipeline()
               << " of " << plan_.pipelines() << (plan_.pipeline() == 0 ? " (the reducer)" : "")
               << ", every " << o.inner_steps << " steps"
               << (o.streaming ? ", streaming" : ", blocking");
  return absl::OkStatus();
}

absl::Status TrainingSession::ActivateTiedExchange(const StageRuntime& runtime) {
  // The first stage's worker and the last's trade the tied matrix's
  // gradient at each update (sync only; no replicas).
  const int other = plan_.first() ? plan_.num_stages() - 1 : 0;
  const std::vector<StageWorker> ends = WorkersOf(plan_.plan().stages(other));
  if (ends.size() != 1 || plan_.replicated() || parts_.tied == nullptr) {
    return absl::FailedPreconditionError(
        "tied embeddings need one worker on the first stage and one on the last");
  }
  TiedGradientExchange::Target target;
  target.epoch = plan_.epoch();
  target.stage = plan_.stage();
  target.self_id = plan_.self_id();
  target.peer_stage = other;
  target.peer_id = ends[0].id;
  auto route = options_.routes.find(ends[0].address);
  target.peer_address = route == options_.routes.end() ? ends[0].address : route->second;
  target.gradient_bytes = StageRuntime::TiedEmbeddingBytes(job_);
  parts_.tied->Activate(std::move(target));
  return absl::OkStatus();
}

PipelineDriverOptions TrainingSession::DriverOptions(const StageRuntime& runtime,
                                                     const ReplicaRouter* router,
                                                     bool stale_weights) {
  PipelineDriverOptions o;
  o.commitments = parts_.commitments;
  o.audit_weights = parts_.audit_weights;
  o.epoch = plan_.epoch();
  o.stage = plan_.stage();
  o.num_stages = plan_.num_stages();
  o.start_step = plan_.start_step();
  o.schedule = plan_.schedule();
  o.dropped_microbatches = options_.dropped_microbatches;
  o.upstream_workers = std::max<int>(1, plan_.upstream().size());
  // Two leases, as long as the coordinator gives a silent worker.
  o.reply_timeout = ReplyTimeoutFor(absl::Milliseconds(2 * job_.lease_ms()), plan_.stage(),
                                    plan_.num_stages());
  o.replicated = plan_.replicated();
  o.primary = plan_.primary();
  if (plan_.first()) {
    // The plan lists stage 0's workers in the same order for every one of
    // them, which fixes each replica's share of the microbatch ids.
    o.stage_replicas = static_cast<int>(plan_.stage_workers().size());
    o.replica_index = plan_.replica_index();
  }
  o.averager = plan_.replicated() ? parts_.replicas : nullptr;
  o.tied = runtime.holds_one_tied_end() ? parts_.tied : nullptr;
  // Joining a stage that is already training.
  o.catching_up = stale_weights && plan_.replicated() && plan_.start_step() > 0;
  o.router = router;
  // Only where the plan chose (the driver says "fixed by the job" otherwise).
  if (plan_.activation_codec_planned()) o.activation_codec = plan_.activation_codec();
  if (plan_.gradient_codec_planned()) o.gradient_codec = plan_.gradient_codec();
  o.upstream_peer = Addresses(plan_.upstream());
  o.downstream_peer = Addresses(plan_.downstream());
  if (plan_.downstream().size() == 1) o.downstream_worker = plan_.downstream()[0].id;
  o.outer = outer_sync_.get();
  o.outer_peers = &outer_peers_;
  if (outer_sync_ != nullptr) o.poll = [this] { return PollAmendments(); };
  o.on_replica_lost = [this](const std::string& peer, uint64_t link_epoch,
                             const std::string& why) {
    ReportLostLink(peer, PeerSide::kReplica, why, link_epoch);
  };
  return o;
}

absl::Status TrainingSession::Run(StageRuntime* runtime, bool stale_weights) {
  if (ran_.exchange(true)) return absl::FailedPreconditionError("a session runs once");
  struct Cleanup {
    TrainingSession* session;
    StageRuntime* runtime;
    ~Cleanup() {
      session->Finish();
      // What stage 0 drew, whatever the exit path: a run's check that no
      // sample was trained twice reads it.
      if (std::optional<StageRuntime::DataDrawn> drawn = runtime->data_drawn()) {
        GT_LOG(Info) << "data drawn in plan epoch " << session->plan_.epoch() << ": indices "
                     << drawn->first << " to " << drawn->last << " every " << drawn->stride
                     << (drawn->per_block > 0
                             ? absl::StrCat(", ", drawn->per_block, " a step in blocks of ",
                                            drawn->block)
                             : "");
      }
    }
  } cleanup{this, runtime};
  if (aborted_) return absl::CancelledError("superseded before it started");
  const int stage = plan_.stage();
  GT_LOG(Info) << "stage " << stage << "/" << plan_.num_stages() << ": layers ["
               << plan_.assignment().layer_begin() << "," << plan_.assignment().layer_end()
               << "), epoch " << plan_.epoch() << ", from step " << plan_.start_step();
  // A runtime kept from an earlier plan takes the new plan's window and
  // codecs: every stage of a plan derives the same window from it, and a
  // stage that kept an older one would break the others' bound.
  runtime->SetMaxWeightVersions(plan_.schedule().max_weight_versions);
  // Pipeline r of R draws its own share of each global step's data.
  runtime->SetDataShard(plan_.data_stride(), plan_.data_lane(), plan_.start_step(),
                        plan_.data_base(), plan_.microbatches(), plan_.data_block());
  runtime->SetActivationCodec(plan_.activation_codec());
  runtime->SetGradientCodec(plan_.gradient_codec());
  current_ = std::make_unique<ServedPlan>(plan_);
  std::shared_ptr<const LinkValidator> validator = ValidatorFor(plan_);
  parts_.coordinator->SetEpoch(plan_.epoch());
  parts_.links->Activate(validator, inbox_, plan_.DiallingDownstream());
  if (plan_.replicated()) ActivateReplicas();
  if (runtime->holds_one_tied_end()) RETURN_IF_ERROR(ActivateTiedExchange(*runtime));

  // Downstream links first: the chain of waits (an end waiting for its
  // neighbour to dial in, or at a relay) then runs toward the last stage,
  // which waits for no one.
  std::vector<ReplicaRouter::Route> routes;
  for (const StageWorker& next : plan_.downstream()) {
    ASSIGN_OR_RETURN(std::shared_ptr<PipelineLink> end,
                     Open(next, PeerSide::kDownstream, validator));
    routes.push_back({next.id, next.address, end.get()});
  }
  for (const StageWorker& previous : plan_.upstream()) {
    RETURN_IF_ERROR(Open(previous, PeerSide::kUpstream, validator).status());
  }
  // Then the outer sync's, once this worker's pipeline can run.
  if (plan_.outer()) RETURN_IF_ERROR(StartOuterSync(runtime, validator));
  std::optional<ReplicaRouter> router;
  if (!routes.empty()) router.emplace(std::move(routes));
  const ScheduleConfig& schedule = plan_.schedule();
  GT_LOG(Info) << "schedule " << ScheduleName(job_.schedule()) << ": window " << schedule.window
               << ", update every " << schedule.update_every << " backward(s)"
               << (schedule.flush ? ", flush each step" : ", no flush");
  MessageSink* up_sink = plan_.first() ? nullptr : parts_.links->upstream();
  MessageSink* down_sink = router ? &*router : nullptr;
  std::unique_ptr<MessageSink> up_wrapper, down_wrapper;
  if (options_.wrap_link) {
    if (up_sink != nullptr) {
      up_wrapper = options_.wrap_link(PeerSide::kUpstream, up_sink);
      up_sink = up_wrapper.get();
    }
    if (down_sink != nullptr) {
      down_wrapper = options_.wrap_link(PeerSide::kDownstream, down_sink);
      down_sink = down_wrapper.get();
    }
  }
  PipelineDriver driver(job_, DriverOptions(*runtime, router ? &*router : nullptr, stale_weights),
                        runtime, up_sink, down_sink, inbox_.get(), parts_.coordinator,
                        parts_.stats);
  if (options_.on_serving) {
    options_.on_serving(true, absl::StrCat("stage ", stage, " of plan epoch ", plan_.epoch(),
                                           ": links open, training"));
  }
  const absl::Status ran = driver.Run();
  if (options_.on_serving) {
    options_.on_serving(false, ran.ok() ? std::string("the job is finished")
                                        : absl::StrCat("stage ", stage, " of plan epoch ",
                                                       plan_.epoch(), " ended: ", ran.message()));
  }
  if (!ran.ok()) {
    ReportFailedLink(driver, ran);
    parts_.links->Deactivate();
    return ran;
  }
  // The final round's means are on their way to the replicas before any
  // link closes.
  if (outer_links_ != nullptr) {
    outer_links_->Flush();
    // The stage's replicas end on the same bytes: what a run's check reads.
    GT_LOG(Info) << "outer sync of stage " << stage << ": " << runtime->outer_rounds()
                 << " rounds applied; final weights sha256 " << runtime->WeightsDigest()
                 << ", outer weights sha256 " << runtime->OuterWeightsDigest();
  }
  CloseLinks();
  GT_LOG(Info) << "stage " << stage << " finished " << job_.steps() << " steps";
  parts_.coordinator->ReportFinalStats(parts_.stats->Get());
  return ReportDone();
}

std::shared_ptr<const LinkValidator> TrainingSession::ValidatorFor(const ServedPlan& plan) const {
  std::set<std::string> upstream_ids, replica_ids;
  std::map<std::string, uint64_t> replica_epochs;
  for (const StageWorker& w : plan.upstream()) upstream_ids.insert(w.id);
  for (const StageWorker& w : plan.outer_link_peers()) {
    replica_ids.insert(w.id);
    replica_epochs[w.id] = plan.OuterLinkEpoch(w);
  }
  return std::make_shared<const LinkValidator>(
      job_, plan.epoch(), plan.stage(), plan.assignment().layer_begin(),
      plan.assignment().layer_end(), std::move(upstream_ids), std::move(replica_ids),
      std::move(replica_epochs));
}

absl::Status TrainingSession::PollAmendments() {
  std::optional<ServedPlan> next;
  std::vector<OpenedLink> opened;
  {
    absl::MutexLock lock(&mu_);
    next.swap(pending_plan_);
    opened.swap(opened_);
  }
  if (next.has_value()) RETURN_IF_ERROR(ApplyAmendment(*next));
  for (OpenedLink& o : opened) {
    auto wanted = wanted_outer_.find(o.peer.id);
    if (wanted == wanted_outer_.end() || wanted->second != o.link_epoch ||
        outer_peers_.count(o.peer.id) > 0) {
      o.link->EndOnPurpose();  // a later plan no longer wants it
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      links_.push_back(o.link);
    }
    outer_links_->Attach(o.peer.pipeline, o.link);
    outer_peers_[o.peer.id] = {o.peer.pipeline, o.link_epoch};
    GT_LOG(Info) << "outer sync of stage " << plan_.stage() << ": pipeline " << o.peer.pipeline
                 << "'s replica '" << o.peer.id << "' joins (link epoch " << o.link_epoch << ")";
    RETURN_IF_ERROR(outer_sync_->Attach(o.peer.pipeline, o.link_epoch, absl::Now()));
  }
  return absl::OkStatus();
}

absl::Status TrainingSession::ApplyAmendment(const ServedPlan& next) {
  const absl::Time now = absl::Now();
  current_ = std::make_unique<ServedPlan>(next);
  std::map<std::string, StageWorker> wanted;
  wanted_outer_.clear();
  for (const StageWorker& peer : next.outer_link_peers()) {
    wanted[peer.id] = peer;
    wanted_outer_[peer.id] = next.OuterLinkEpoch(peer);
  }
  // The replicas gone, or whose pipelines were formed anew: their links end
  // on purpose (nothing is reported) and the sync goes on without them.
  for (auto it = outer_peers_.begin(); it != outer_peers_.end();) {
    auto w = wanted.find(it->first);
    if (w != wanted.end() && w->second.pipeline == it->second.pipeline &&
        wanted_outer_[it->first] == it->second.link_epoch) {
      ++it;
      continue;
    }
    if (std::shared_ptr<PipelineLink> link = outer_links_->Remove(it->second.pipeline)) {
      link->EndOnPurpose();
    }
    GT_LOG(Info) << "outer sync of stage " << plan_.stage() << ": pipeline "
                 << it->second.pipeline << "'s replica '" << it->first
                 << "' leaves (plan epoch " << next.plan_epoch() << ")";
    RETURN_IF_ERROR(outer_sync_->Leave(it->second.pipeline, now));
    it = outer_peers_.erase(it);
  }
  // New dial-ins are checked against the new plan; the links kept keep
  // their own validators.
  std::shared_ptr<const LinkValidator> validator = ValidatorFor(next);
  parts_.links->Activate(validator, inbox_, plan_.DiallingDownstream());
  for (const auto& [id, peer] : wanted) {
    if (outer_peers_.count(id) > 0) continue;
    const uint64_t link_epoch = wanted_outer_[id];
    openers_.emplace_back([this, next, peer = peer, link_epoch,
                           link_validator = validator->ForReplicaLink(id)] {
      absl::StatusOr<std::shared_ptr<PipelineLink>> link =
          OpenIn(next, peer, PeerSide::kReplica, link_validator, &closing_, link_epoch);
      if (!link.ok()) return;  // reported; the sync goes on without it
      absl::MutexLock lock(&mu_);
      if (closing_) {
        (*link)->EndOnPurpose();
        return;
      }
      opened_.push_back({peer, link_epoch, *std::move(link)});
    });
  }
  GT_LOG(Info) << "plan epoch " << next.plan_epoch() << ": pipeline " << plan_.pipeline()
               << " goes on (formed in epoch " << plan_.epoch() << "); stage " << plan_.stage()
               << " has " << next.outer_link_peers().size() << " outer-sync peer(s)";
  if (options_.on_amended) options_.on_amended(next);
  return absl::OkStatus();
}

void TrainingSession::ReportFailedLink(const PipelineDriver& driver, const absl::Status& ran) {
  // A broken link (not one this worker ended itself) is reported with the
  // neighbour at its other end, so the coordinator can route around it
  // without waiting for a lease: a blackholed link never ends a lease. The
  // report goes before this worker ends its other links: ending them breaks
  // its healthy neighbours' links too, and their reports (naming this
  // worker) must not reach the coordinator first, or it would take out this
  // worker instead of the peer that failed.
  const PipelineDriver::FailedLink failed = driver.failed_link();
  if (failed == PipelineDriver::FailedLink::kNone || aborted_) return;
  const PeerSide side = failed == PipelineDriver::FailedLink::kUpstream     ? PeerSide::kUpstream
                        : failed == PipelineDriver::FailedLink::kDownstream ? PeerSide::kDownstream
                                                                            : PeerSide::kReplica;
  uint64_t epoch = 0;
  if (auto peer = outer_peers_.find(driver.failed_peer());
      side == PeerSide::kReplica && peer != outer_peers_.end()) {
    epoch = peer->second.link_epoch;
  }
  ReportLostLink(driver.failed_peer(), side, ran.message(), epoch);
}

void TrainingSession::ReportLostLink(const std::string& peer_id, PeerSide side,
                                     absl::string_view why, uint64_t epoch) const {
  if (aborted_) return;
  // An outer-sync peer is the newest plan's (the pipeline's neighbours
  // never change while the session lasts).
  const ServedPlan& plan = side == PeerSide::kReplica && current_ != nullptr ? *current_ : plan_;
  const std::vector<StageWorker>& neighbours = side == PeerSide::kUpstream   ? plan.upstream()
                                               : side == PeerSide::kDownstream ? plan.downstream()
                                                                             : plan.outer_link_peers();
  StageWorker peer = neighbours.empty() ? StageWorker() : neighbours[0];
  for (const StageWorker& w : neighbours) {
    if (w.id == peer_id) peer = w;
  }
  // Through a relay, the relay is what is reported: the coordinator
  // re-links the pair through another (see JobController).
  const v1::PlannedLink* planned = plan.LinkTo(peer, side);
  const bool relayed = planned != nullptr && planned->dialer() == v1::LINK_DIALER_RELAY;
  parts_.coordinator->ReportEventOfEpoch(
      epoch != 0 ? epoch : plan_.epoch(), "link_lost",
      absl::StrCat(PeerSideName(side), " link to ", peer.address,
                   relayed ? " via relay " + planned->relay_address() : "", ": ", why),
      relayed ? planned->relay_worker() : peer.id);
}

void TrainingSession::CloseLinks() {
  // A link a peer opened here ends when that peer closes it.
  std::vector<std::shared_ptr<PipelineLink>> links;
  {
    absl::MutexLock lock(&mu_);
    links = links_;
  }
  for (PeerSide side : {PeerSide::kDownstream, PeerSide::kUpstream, PeerSide::kReplica}) {
    for (const std::shared_ptr<PipelineLink>& link : links) {
      if (link->side() != side) continue;
      absl::Status closed = link->Close(parts_.links->close_timeout());
      if (!closed.ok()) GT_LOG(Warning) << "closing a link: " << closed.message();
    }
  }
}

absl::Status TrainingSession::ReportDone() {
  // The coordinator may be restarting: keep trying for a while.
  absl::Status done = parts_.coordinator->ReportDone(job_.steps());
  for (int attempt = 1; !done.ok() && attempt < options_.done_attempts && !aborted_; ++attempt) {
    absl::SleepFor(options_.done_retry_interval);
    done = parts_.coordinator->ReportDone(job_.steps());
  }
  return done;
}

}  // namespace geotrain
