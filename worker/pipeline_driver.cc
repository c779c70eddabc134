#include "worker/pipeline_driver.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/commitment.h"
#include "common/job_spec.h"
#include "common/logging.h"
#include "common/process_stats.h"
#include "common/status_macros.h"
#include "common/update_audit_size.h"
#include "worker/outer_links.h"

namespace geotrain {

ScheduleConfig ConfigureSchedule(const v1::JobSpec& job, int num_stages, int planned_window) {
  ScheduleConfig config;
  const int stages = std::max(1, num_stages);
  const int window = job.in_flight() > 0    ? job.in_flight()
                     : planned_window > 0 ? std::min(std::max(planned_window, stages), kMaxPlannedWindow)
                                          : stages;
  switch (job.schedule()) {
    case v1::SCHEDULE_ASYNC_STASH:
      config.window = window;
      config.update_every = std::max(1, job.update_every());
      config.flush = false;
      config.max_weight_versions = window;
      break;
    case v1::SCHEDULE_ASYNC_2BW:
      config.window = std::min(window, job.microbatches());
      config.update_every = job.microbatches();
      config.flush = false;
      config.max_weight_versions = 2;
      break;
    default:  // sync
      config.window = stages;
      config.update_every = job.microbatches();
      config.flush = true;
      config.max_weight_versions = 1;
      break;
  }
  return config;
}

PipelineDriver::PipelineDriver(const v1::JobSpec& job,
                               const PipelineDriverOptions& options,
                               StageRuntime* runtime, MessageSink* upstream,
                               MessageSink* downstream, Inbox* inbox,
                               ProgressSink* progress, StatsBoard* stats)
    : job_(job),
      options_(options),
      runtime_(runtime),
      upstream_(upstream),
      downstream_(downstream),
      inbox_(inbox),
      progress_(progress),
      stats_(stats) {
  if (job_.adaptive()) {
    AdaptiveCodecOptions adaptive;
    adaptive.topk_fraction = job_.topk_fraction();
    const v1::Codec down = options_.activation_codec != v1::CODEC_UNSPECIFIED
                               ? options_.activation_codec
                               : job_.activation_codec();
    const v1::Codec up = options_.gradient_codec != v1::CODEC_UNSPECIFIED
                             ? options_.gradient_codec
                             : job_.gradient_codec();
    down_link_.selector.emplace(CodecLadder(down), adaptive);
    up_link_.selector.emplace(CodecLadder(up), adaptive);
    runtime_->SetActivationCodec(down_link_.selector->codec());
    runtime_->SetGradientCodec(up_link_.selector->codec());
  }
}

absl::Status PipelineDriver::Run() {
  start_ = absl::Now();
  idle_ = absl::ZeroDuration();
  backwards_ = static_cast<int64_t>(options_.start_step) * job_.microbatches();
  position_ = backwards_;
  catching_up_ = options_.catching_up;
  samples_.push_back({start_, idle_, send_total_, backwards_});
  PublishStats();
  absl::Status status = options_.stage == 0 ? RunFirstStage() : RunLaterStage();
  PublishStats();  // the final figures, whatever the throttle skipped
  return status;
}

absl::Status PipelineDriver::RefusedFrom(const InboundMessage& in, absl::Status status) {
  if (status.ok() || !absl::IsInvalidArgument(status)) return status;
  failed_link_ = in.from_upstream ? FailedLink::kUpstream : FailedLink::kDownstream;
  failed_peer_ = in.peer;
  return absl::UnavailableError(absl::StrCat(
      "a message from ", in.peer.empty() ? (in.from_upstream ? "upstream" : "downstream") : in.peer,
      " refused: ", status.message()));
}

absl::Duration ReplyTimeoutFor(absl::Duration base, int stage, int num_stages) {
  return base * std::max(1, num_stages - 1 - stage);
}

absl::StatusOr<InboundMessage> PipelineDriver::NextMessage() {
  const absl::Time waiting = absl::Now();
  // Owed a message by the downstream stage, once it has answered at all in
  // this run (before that it may still be restoring its state): the
  // timeout, or ten times the longest such wait so far (a slow stage is
  // not a stalled one).
  const bool owed = pending_down_ > 0 && downstream_ != nullptr && longest_owed_wait_ > absl::ZeroDuration();
  const absl::Duration timeout =
      owed ? std::max(options_.reply_timeout, 10 * longest_owed_wait_) : absl::InfiniteDuration();
  // In slices of a second: past the first, the heartbeat says whom this
  // stage waits on (the coordinator's watchdog follows that).
  std::optional<InboundMessage> in;
  bool announced = false;
  while (true) {
    const absl::Duration left = timeout - (absl::Now() - waiting);
    in = PopMessage(std::min(left, absl::Seconds(1)));
    if (!outer_failure_.ok()) return outer_failure_;
    if (in.has_value() || inbox_->closed() || absl::Now() - waiting >= timeout) break;
    if (pending_down_ > 0 && downstream_ != nullptr && stats_ != nullptr && !announced) {
      std::string peer = downstream_->oldest_pending_peer();
      stats_->SetWaiting(peer.empty() ? options_.downstream_worker : peer, waiting);
      announced = true;
    }
  }
  if (announced) stats_->SetWaiting("", absl::Time());
  const absl::Duration waited = absl::Now() - waiting;
  idle_ += waited;
  if (!in.has_value() && owed && !inbox_->closed()) {
    failed_link_ = FailedLink::kDownstream;
    failed_peer_ = downstream_->oldest_pending_peer();
    return absl::UnavailableError(absl::StrCat(
        "the downstream link is stalled: ", pending_down_, " microbatches sent and nothing back "
        "for ", absl::FormatDuration(timeout)));
  }
  if (pending_down_ > 0 && in.has_value() && !in->from_upstream) {
    longest_owed_wait_ = std::max(longest_owed_wait_, std::max(waited, absl::Nanoseconds(1)));
  }
  if (!in.has_value()) return absl::CancelledError("worker is stopping");
  if (!in->from_upstream && in->error.ok()) {
    const v1::MessageKind kind = in->message.header.kind();
    if (kind == v1::MESSAGE_KIND_GRADIENT || kind == v1::MESSAGE_KIND_EVAL_ACK) {
      pending_down_ = std::max<int64_t>(0, pending_down_ - 1);
    }
  }
  if (!in->error.ok()) {
    failed_link_ = in->from_upstream ? FailedLink::kUpstream : FailedLink::kDownstream;
    failed_peer_ = in->peer;
    return in->error;
  }
  CountReceived(*in);
  if (options_.commitments != nullptr) {
    options_.commitments->RecordReceived(in->message, in->peer, absl::Now());
  }
  return *std::move(in);
}

std::optional<InboundMessage> PipelineDriver::PopMessage(absl::Duration timeout) {
  if (!set_aside_.empty()) {
    InboundMessage in = std::move(set_aside_.front());
    set_aside_.pop_front();
    return in;
  }
  OuterSync* outer = options_.outer;
  const absl::Time until = absl::Now() + timeout;
  while (true) {
    if (options_.poll) {
      outer_failure_ = options_.poll();
      if (!outer_failure_.ok()) return std::nullopt;
    }
    absl::Time wake = std::min(until, absl::Now() + absl::Seconds(1));
    if (outer != nullptr) {
      if (outer->NextDeadline() <= absl::Now()) {
        outer_failure_ = outer->OnTime(absl::Now());
        if (!outer_failure_.ok()) return std::nullopt;
      }
      wake = std::min(wake, outer->NextDeadline());
    }
    std::optional<InboundMessage> in =
        inbox_->Pop(std::max(absl::ZeroDuration(), wake - absl::Now()));
    if (!in.has_value()) {
      if (absl::Now() >= until || inbox_->closed()) return std::nullopt;
      continue;  // an outer deadline, or time to poll
    }
    if (!in->from_replica) return in;
    outer_failure_ = HandleOuter(*std::move(in));
    if (!outer_failure_.ok()) return std::nullopt;
  }
}

absl::Status PipelineDriver::HandleOuter(InboundMessage in) {
  OuterSync* outer = options_.outer;
  if (outer == nullptr) {
    failed_link_ = FailedLink::kReplica;
    failed_peer_ = in.peer;
    return absl::UnavailableError(
        absl::StrCat("an outer-sync message from ", in.peer, " to a stage that has none"));
  }
  const OuterPeer* peer = OuterPeerOf(in.peer);
  // The last words of a link a re-plan replaced (or one it ended).
  if (peer == nullptr || peer->link_epoch != in.link_epoch) return absl::OkStatus();
  if (!in.error.ok()) {
    // Once the final round is applied the replicas' links may end as they
    // finish: nothing more is owed on them.
    if (outer->finished()) return absl::OkStatus();
    return LoseReplica(in.peer, std::string(in.error.message()));
  }
  outer_bytes_received_ += in.message.payload.size();
  absl::StatusOr<OuterMessage> message = FromLinkMessage(in.message);
  absl::Status handled =
      message.ok() ? outer->OnMessage(*message, absl::Now()) : message.status();
  if (absl::IsInvalidArgument(handled)) {
    return LoseReplica(in.peer, absl::StrCat("its message was refused: ", handled.message()));
  }
  return handled;
}

absl::Status PipelineDriver::LoseReplica(const std::string& peer, const std::string& why) {
  OuterSync* outer = options_.outer;
  const OuterPeer* found = OuterPeerOf(peer);
  if (found == nullptr) {
    return absl::InternalError(absl::StrCat("an outer-sync link to '", peer, "', not a replica"));
  }
  const OuterPeer lost = *found;
  GT_LOG(Warning) << "outer sync: lost the replica '" << peer << "' of pipeline "
                  << lost.pipeline << " (" << why << "); this pipeline goes on without it";
  RETURN_IF_ERROR(outer->Detach(lost.pipeline, absl::Now()));
  if (options_.on_replica_lost) options_.on_replica_lost(peer, lost.link_epoch, why);
  return absl::OkStatus();
}

const OuterPeer* PipelineDriver::OuterPeerOf(const std::string& peer) const {
  if (options_.outer_peers == nullptr) return nullptr;
  auto it = options_.outer_peers->find(peer);
  return it == options_.outer_peers->end() ? nullptr : &it->second;
}

std::string PipelineDriver::OuterReducer() const {
  if (options_.outer_peers == nullptr) return "";
  for (const auto& [id, peer] : *options_.outer_peers) {
    if (peer.pipeline == 0) return id;
  }
  return "";
}

absl::Status PipelineDriver::AwaitOuterMean() {
  OuterSync* outer = options_.outer;
  if (outer == nullptr) return absl::OkStatus();
  const absl::Time start = absl::Now();
  // Take what has arrived (a streaming replica applies the means that
  // came during its inner steps), then wait while a mean is owed.
  while (true) {
    if (options_.poll) RETURN_IF_ERROR(options_.poll());
    const bool waiting = outer->MustWait();
    // What the reducer's transfers take at the outer pace comes on top.
    const absl::Duration timeout = options_.outer_timeout + outer->WaitAllowance();
    if (waiting && absl::Now() - start > timeout && !OuterReducer().empty()) {
      RETURN_IF_ERROR(LoseReplica(
          OuterReducer(),
          absl::StrCat("no outer mean for round ", outer->rounds_applied() + 1, " within ",
                       absl::FormatDuration(timeout))));
      continue;
    }
    absl::Duration wait = absl::ZeroDuration();
    if (waiting) {
      wait = std::clamp(outer->NextDeadline() - absl::Now(), absl::ZeroDuration(),
                        absl::Seconds(1));
    }
    std::optional<InboundMessage> in = inbox_->Pop(wait);
    RETURN_IF_ERROR(outer->OnTime(absl::Now()));
    if (in.has_value()) {
      if (in->from_replica) {
        RETURN_IF_ERROR(HandleOuter(*std::move(in)));
      } else {
        set_aside_.push_back(*std::move(in));
      }
      continue;
    }
    if (inbox_->closed()) return absl::CancelledError("worker is stopping");
    if (!waiting && !outer->MustWait()) break;
  }
  idle_ += absl::Now() - start;
  return absl::OkStatus();
}

namespace {
uint64_t RawBytes(const v1::LinkHeader& header) {
  uint64_t raw = 0;
  for (const v1::TensorHeader& t : header.tensors()) {
    uint64_t elements = 1;
    for (int64_t d : t.shape()) elements *= static_cast<uint64_t>(d);
    raw += elements * DTypeSize(t.dtype());
  }
  return raw;
}
}  // namespace

void PipelineDriver::CountReceived(const InboundMessage& in) {
  LinkState& link = in.from_upstream ? up_link_ : down_link_;
  const LinkMessage& message = in.message;
  if (message.header.receive_rate_bps() > 0) link.peer_rate_bps = message.header.receive_rate_bps();
  if (message.payload.empty()) return;
  link.bytes_received += message.payload.size();
  link.raw_bytes_received += RawBytes(message.header);
  link.receive_meter.OnMessage(in.trailing_bytes, in.dispersion, in.after_stall);
  link.received_norms.Observe(message);
}

double PipelineDriver::RecentComputeSeconds() const {
  const Sample& first = samples_.front();
  const Sample& last = samples_.back();
  const int64_t done = last.backwards - first.backwards;
  if (done <= 0) return 0;
  const absl::Duration busy =
      (last.time - first.time) - (last.idle - first.idle) - (last.send - first.send);
  return std::max(0.0, absl::ToDoubleSeconds(busy) / done);
}

void PipelineDriver::ObserveLink(LinkState* link, bool activations) {
  // One observation every few messages, so that each sees new samples.
  if (!link->selector || ++link->messages_since_observation < 4) return;
  link->messages_since_observation = 0;
  const double link_s =
      link->peer_rate_bps > 0 ? 8 * link->wire_bytes_per_message / link->peer_rate_bps : 0;
  if (!link->selector->Observe(link_s, RecentComputeSeconds())) return;
  const v1::Codec codec = link->selector->codec();
  if (activations) {
    runtime_->SetActivationCodec(codec);
  } else {
    runtime_->SetGradientCodec(codec);
  }
  link->wire_bytes_per_message = 0;  // sizes at the old codec no longer apply
  GT_LOG(Info) << (activations ? "activations" : "gradients") << ": "
               << link->selector->reason();
}

absl::Status PipelineDriver::CountedSend(MessageSink* sink, LinkMessage message,
                                         LinkState* link) {
  message.header.set_receive_rate_bps(link->receive_meter.rate_bps());
  for (const v1::TensorHeader& t : message.header.tensors()) {
    if (t.dtype() == v1::DTYPE_FLOAT32) link->codec = CodecName(t.codec());
  }
  link->raw_bytes += RawBytes(message.header);
  link->bytes += message.payload.size();
  ++link->messages;
  const v1::MessageKind kind = message.header.kind();
  const bool training = kind == v1::MESSAGE_KIND_ACTIVATION || kind == v1::MESSAGE_KIND_GRADIENT;
  // Last, once the header is final: what the receiver holds this worker to.
  if (IsCommittedKind(kind)) {
    message.header.set_commitment(CommitmentOf(message.header, message.payload));
    // The log keeps a copy of its bytes for a spot check's input while
    // they fit its bound (CommitmentLogOptions).
    if (options_.commitments != nullptr) options_.commitments->RecordSent(message, absl::Now());
  }
  if (training) {
    const double bytes = static_cast<double>(message.payload.size());
    link->wire_bytes_per_message = link->wire_bytes_per_message == 0
                                       ? bytes
                                       : 0.75 * link->wire_bytes_per_message + 0.25 * bytes;
  }
  const absl::Time start = absl::Now();
  absl::Status sent = sink->Send(std::move(message));
  const absl::Duration took = absl::Now() - start;
  link->send_time += took;
  send_total_ += took;
  if (sent.ok() && training) ObserveLink(link, kind == v1::MESSAGE_KIND_ACTIVATION);
  return sent;
}

absl::Status PipelineDriver::SendDown(LinkMessage message) {
  if (downstream_ == nullptr) return absl::InternalError("no downstream link");
  const v1::MessageKind kind = message.header.kind();
  if (kind == v1::MESSAGE_KIND_ACTIVATION || kind == v1::MESSAGE_KIND_EVAL) ++pending_down_;
  message.header.set_epoch(options_.epoch);
  message.header.set_from_stage(options_.stage);
  absl::Status sent = CountedSend(downstream_, std::move(message), &down_link_);
  if (absl::IsUnavailable(sent)) {
    failed_link_ = FailedLink::kDownstream;
    failed_peer_ = downstream_->failed_peer();
  }
  return sent;
}

absl::Status PipelineDriver::SendUp(LinkMessage message) {
  if (upstream_ == nullptr) return absl::InternalError("no upstream link");
  message.header.set_epoch(options_.epoch);
  message.header.set_from_stage(options_.stage);
  absl::Status sent = CountedSend(upstream_, std::move(message), &up_link_);
  if (absl::IsUnavailable(sent)) {
    failed_link_ = FailedLink::kUpstream;
    failed_peer_ = upstream_->failed_peer();
  }
  return sent;
}

absl::Status PipelineDriver::AfterBackward(double loss, uint64_t microbatch) {
  ++backwards_;
  const int64_t position_before = position_;
  position_ = options_.replicated
                  ? std::max<int64_t>(position_, static_cast<int64_t>(microbatch) + 1)
                  : backwards_;
  if (++backwards_since_update_ == options_.schedule.update_every) {
    // The learning-rate schedule's position is the fraction of the run's
    // microbatches finished, so every schedule follows the same curve.
    const double total = static_cast<double>(job_.steps()) * job_.microbatches();
    StageRuntime::TiedGradientExchangeFn exchange_tied;
    if (options_.tied != nullptr) {
      // The update's name on both ends: the microbatches finished by then.
      exchange_tied = [this](std::string_view mine) {
        return options_.tied->Exchange(position_, mine);
      };
    }
    RETURN_IF_ERROR(runtime_->ApplyUpdate(position_ / total, exchange_tied));
    backwards_since_update_ = 0;
    AverageReceivedWeights();
  }
  if (runtime_->is_last()) {
    step_loss_sum_ += loss;
    ++step_losses_;
  }
  const absl::Time now = absl::Now();
  samples_.push_back({now, idle_, send_total_, backwards_});
  while (samples_.size() > 2 && now - samples_[1].time > options_.stats_window) {
    samples_.pop_front();
  }
  // Publishing reads /proc and walks the stash: a few times a second is
  // plenty for heartbeats, and keeps it off the per-microbatch path.
  if (now - last_published_ >= absl::Milliseconds(200)) PublishStats();
  const int microbatches = job_.microbatches();
  // Every step boundary passed (a replica may jump more than one).
  for (int64_t step = position_before / microbatches + 1; step <= position_ / microbatches;
       ++step) {
    RETURN_IF_ERROR(AtStep(static_cast<int>(step)));
  }
  // Checkpoints are taken right after an update, so they hold whole
  // updates. Without replicas updates fall on step boundaries (update_every
  // divides M); a replica's need not.
  if (checkpoint_due_ > 0 && backwards_since_update_ == 0) {
    const int step = checkpoint_due_;
    checkpoint_due_ = 0;
    const uint64_t bytes = runtime_->StateBytes();
    if (bytes > kLargestCheckpointSnapshot) {
      const absl::Status uploaded = progress_->UploadCheckpointNow(
          bytes, [this, step](const std::function<bool(const v1::LayerStateChunk&)>& emit) {
            return runtime_->StreamCheckpoint(step, emit);
          });
      // A lost checkpoint costs only recovery time, never the run.
      if (!uploaded.ok()) {
        GT_LOG(Warning) << "checkpoint of step " << step << " not saved: " << uploaded.message();
      }
    } else {
      ASSIGN_OR_RETURN(std::vector<v1::LayerCheckpoint> layers, runtime_->ExportCheckpoint(step));
      progress_->CheckpointReady(std::move(layers));
    }
  }
  return absl::OkStatus();
}

absl::Status PipelineDriver::AtStep(int step) {
  const int microbatches = job_.microbatches();
  if (runtime_->is_last()) {
    progress_->StepFinished(step, step_loss_sum_ / std::max(1, step_losses_),
                            static_cast<int64_t>(microbatches) * job_.microbatch_size());
    step_loss_sum_ = 0;
    step_losses_ = 0;
  }
  progress_->StageProgress(step);
  if (options_.stage == 0 && !runtime_->is_last()) progress_->FirstStageFinished(step);
  if (options_.outer != nullptr) {
    // Before the checkpoint and the evaluation of this step: both see the
    // outer weights when a round ends here.
    samples_since_round_ += static_cast<int64_t>(microbatches) * job_.microbatch_size();
    const bool round_ends = options_.outer->RoundEndingAt(step).has_value();
    RETURN_IF_ERROR(options_.outer->AfterStep(step, samples_since_round_, absl::Now()));
    if (round_ends) samples_since_round_ = 0;
    RETURN_IF_ERROR(AwaitOuterMean());
  }
  if (options_.primary && job_.checkpoint_every() > 0 && step % job_.checkpoint_every() == 0) {
    checkpoint_due_ = step;  // taken at this update, or (a replica) the next
  }
  if (options_.averager != nullptr && step % job_.replica_sync_every() == 0) {
    WireEncoding encoding;
    encoding.codec = job_.replica_codec();
    encoding.block_size = job_.codec_block_size();
    encoding.zstd = job_.zstd();
    ASSIGN_OR_RETURN(std::vector<v1::LayerWeights> weights, runtime_->ExportWeights(encoding));
    options_.averager->Push(step, std::move(weights), catching_up_);
  }
  if (options_.stage == 0 && options_.primary &&
      (step == job_.steps() || (job_.eval_every() > 0 && step % job_.eval_every() == 0))) {
    eval_due_ = step;  // RunFirstStage starts the pass
  }
  return absl::OkStatus();
}

void PipelineDriver::AverageReceivedWeights() {
  if (options_.averager == nullptr) return;
  ReceivedWeights received = options_.averager->TakeReceived(catching_up_);
  if (received.layers.empty()) return;
  absl::Status averaged = runtime_->AverageWeights(received.layers, received.adopt);
  if (!averaged.ok()) {
    // A bad push costs one round of averaging, never the stage.
    GT_LOG(Warning) << "replica weights not averaged: " << averaged.message();
    return;
  }
  if (catching_up_) {
    GT_LOG(Info) << (received.adopt ? "took a sibling replica's weights"
                                    : "averaged with another new replica")
                 << "; no longer catching up";
  }
  catching_up_ = false;
  ++weight_averages_;
}

int64_t PipelineDriver::OwnIdFrom(int64_t id) const {
  const int64_t replicas = std::max(1, options_.stage_replicas);
  const int64_t offset = ((options_.replica_index - id) % replicas + replicas) % replicas;
  return id + offset;
}

absl::Status PipelineDriver::RunFirstStage() {
  const int microbatches = job_.microbatches();
  const ScheduleConfig& schedule = options_.schedule;
  const int64_t end = static_cast<int64_t>(job_.steps()) * microbatches;
  const int replicas = std::max(1, options_.stage_replicas);
  // The job's window is shared among stage 0's replicas.
  const int window = std::max(1, (schedule.window + replicas - 1) / replicas);
  int64_t next = OwnIdFrom(backwards_);
  int in_flight = 0;
  while (true) {
    // A single-stage pipeline reads no link, so the closed inbox (the
    // session aborted: a newer plan, a refusal) is its only stop signal.
    if (inbox_->closed()) return absl::CancelledError("worker is stopping");
    if (eval_due_ > 0 && runtime_->is_last()) {  // a single-stage pipeline
      RETURN_IF_ERROR(RunEvaluation(eval_due_));
      eval_due_ = 0;
    }
    // A pass starts at once under an async schedule; with a flush, once
    // the step's microbatches have returned (they have at its boundary).
    if (eval_due_ > 0 && eval_pass_ == 0 && (!schedule.flush || in_flight == 0)) {
      eval_pass_ = eval_due_;
      eval_next_ = 0;
      eval_due_ = 0;
    }
    // Its microbatches take the window's free places, each counted until
    // acknowledged: the window bounds every queue, with or without an
    // evaluation, so its forwards cannot close a cycle of full queues.
    while (eval_pass_ > 0 && in_flight < window) {
      const bool microbatch = eval_next_ < runtime_->num_eval_microbatches();
      RETURN_IF_ERROR(SendNextEvalMicrobatch());
      if (microbatch) ++in_flight;
    }
    if (next >= end && in_flight == 0 && eval_pass_ == 0) {
      // A replica's last id need not be the run's: once its share is done,
      // the steps after its newest id are over too as far as it can tell,
      // so their boundaries (the primary's final evaluation) pass here.
      if (position_ < end) {
        const int64_t before = position_;
        position_ = end;
        for (int64_t step = before / microbatches + 1; step <= end / microbatches; ++step) {
          RETURN_IF_ERROR(AtStep(static_cast<int>(step)));
        }
      }
      if (eval_due_ > 0 || eval_pass_ > 0) continue;
      break;
    }
    // With a flush, step s+1 starts only after step s has fully returned
    // (sync, which has no replicas).
    const int64_t issue_limit =
        schedule.flush ? std::min(end, (backwards_ / microbatches + 1) * microbatches) : end;
    while (eval_due_ == 0 && eval_pass_ == 0 && next < issue_limit && in_flight < window) {
      const int step = static_cast<int>(next / microbatches);
      ASSIGN_OR_RETURN(LinkMessage input,
                       runtime_->LoadTrainMicrobatchById(step, next));
      next += replicas;
      KeepWeightsForAudit();
      if (runtime_->is_last()) {  // a single-stage pipeline
        ASSIGN_OR_RETURN(LastStageResult result, runtime_->ForwardLoss(input));
        RETURN_IF_ERROR(AfterBackward(result.loss, input.header.microbatch()));
        continue;
      }
      ASSIGN_OR_RETURN(LinkMessage activation, runtime_->Forward(input));
      StampWeightsDigest(&activation);
      RETURN_IF_ERROR(SendDown(std::move(activation)));
      ++in_flight;
    }
    if (in_flight == 0) continue;
    ASSIGN_OR_RETURN(InboundMessage in, NextMessage());
    if (in.from_upstream) {
      return absl::InternalError("stage 0 received a message from upstream");
    }
    if (in.message.header.kind() == v1::MESSAGE_KIND_EVAL_ACK) {
      --in_flight;
      continue;
    }
    downstream_->OnReply(in.message.header.microbatch());
    absl::StatusOr<std::optional<LinkMessage>> up_or = runtime_->Backward(in.message);
    if (!up_or.ok()) return RefusedFrom(in, up_or.status());
    std::optional<LinkMessage> up = *std::move(up_or);
    --in_flight;
    RETURN_IF_ERROR(AfterBackward(0, in.message.header.microbatch()));
  }
  if (!runtime_->is_last()) {
    LinkMessage done;
    done.header.set_kind(v1::MESSAGE_KIND_DONE);
    done.header.set_step(job_.steps());
    RETURN_IF_ERROR(SendDown(std::move(done)));
  }
  return absl::OkStatus();
}

absl::Status PipelineDriver::RunEvaluation(int step) {
  const int batches = runtime_->num_eval_microbatches();
  for (int i = 0; i < batches; ++i) {
    ASSIGN_OR_RETURN(LinkMessage input, runtime_->LoadEvalMicrobatch(i));
    input.header.set_step(step);  // which pass
    RETURN_IF_ERROR(runtime_->EvalForward(input));
  }
  progress_->EvalFinished(step, runtime_->TakeEvalResult(step));
  return absl::OkStatus();
}

absl::Status PipelineDriver::SendNextEvalMicrobatch() {
  if (eval_next_ >= runtime_->num_eval_microbatches()) {
    LinkMessage end;
    end.header.set_kind(v1::MESSAGE_KIND_EVAL_END);
    end.header.set_step(eval_pass_);
    eval_pass_ = 0;
    return SendDown(std::move(end));
  }
  ASSIGN_OR_RETURN(LinkMessage input, runtime_->LoadEvalMicrobatch(eval_next_++));
  input.header.set_step(eval_pass_);  // which pass, for the last stage
  ASSIGN_OR_RETURN(LinkMessage activation, runtime_->Forward(input));
  return SendDown(std::move(activation));
}

void PipelineDriver::KeepWeightsForAudit() {
  AuditWeights* kept = options_.audit_weights;
  if (kept == nullptr || !kept->enabled()) return;
  const int64_t version = runtime_->current_weight_version();
  if (version == audit_kept_version_) return;
  audit_kept_version_ = version;
  // The outputs of this version commit to its digest (StampWeightsDigest).
  audit_kept_digest_ = runtime_->WeightsDigest();
  KeptWeights weights;
  weights.layer_begin = runtime_->layer_begin();
  weights.version = version;
  weights.digest = audit_kept_digest_;
  weights.export_layers = runtime_->ExportWeightsLater();
  weights.weight_bytes = runtime_->WeightBytes();
  weights.bytes = weights.weight_bytes;
  // The optimizer state too where the stage's updates can be audited; the
  // outputs commit to it and to the syncs so far (StampWeightsDigest).
  audit_kept_state_digest_.clear();
  audit_kept_weight_syncs_ = runtime_->weight_syncs();
  if (UpdateAuditFits(weights.weight_bytes / sizeof(float), job_.optimizer())) {
    weights.export_with_state = runtime_->ExportWeightsLater(/*with_optimizer_state=*/true);
    weights.bytes += runtime_->OptimizerStateBytes();
    audit_kept_state_digest_ = runtime_->OptimizerStateDigest();
  }
  kept->Keep(std::move(weights));
}

void PipelineDriver::StampWeightsDigest(LinkMessage* message) const {
  if (audit_kept_version_ < 0 || message->header.weight_versions().empty() ||
      message->header.weight_versions().rbegin()[0] != audit_kept_version_) {
    return;
  }
  message->header.set_weights_digest(audit_kept_digest_);
  message->header.set_state_digest(audit_kept_state_digest_);
  message->header.set_weight_syncs(audit_kept_weight_syncs_);
}

absl::Status PipelineDriver::RunLaterStage() {
  while (true) {
    ASSIGN_OR_RETURN(InboundMessage in, NextMessage());
    const v1::LinkHeader& header = in.message.header;
    switch (header.kind()) {
      case v1::MESSAGE_KIND_ACTIVATION:
        KeepWeightsForAudit();
        if (runtime_->is_last()) {
          absl::StatusOr<LastStageResult> result_or = runtime_->ForwardLoss(in.message);
          if (!result_or.ok()) return RefusedFrom(in, result_or.status());
          LastStageResult result = *std::move(result_or);
          StampWeightsDigest(&*result.gradient);
          RETURN_IF_ERROR(SendUp(*std::move(result.gradient)));
          RETURN_IF_ERROR(AfterBackward(result.loss, header.microbatch()));
        } else {
          absl::StatusOr<LinkMessage> activation_or = runtime_->Forward(in.message);
          if (!activation_or.ok()) return RefusedFrom(in, activation_or.status());
          LinkMessage activation = *std::move(activation_or);
          StampWeightsDigest(&activation);
          RETURN_IF_ERROR(SendDown(std::move(activation)));
        }
        break;
      case v1::MESSAGE_KIND_GRADIENT: {
        downstream_->OnReply(header.microbatch());
        absl::StatusOr<std::optional<LinkMessage>> up_or = runtime_->Backward(in.message);
        if (!up_or.ok()) return RefusedFrom(in, up_or.status());
        std::optional<LinkMessage> up = *std::move(up_or);
        RETURN_IF_ERROR(SendUp(*std::move(up)));
        RETURN_IF_ERROR(AfterBackward(0, header.microbatch()));
        break;
      }
      case v1::MESSAGE_KIND_EVAL:
        if (runtime_->is_last()) {
          RETURN_IF_ERROR(RefusedFrom(in, runtime_->EvalForward(in.message)));
          LinkMessage ack;  // frees its place in stage 0's window
          ack.header.set_kind(v1::MESSAGE_KIND_EVAL_ACK);
          ack.header.set_step(header.step());
          ack.header.set_microbatch(header.microbatch());
          RETURN_IF_ERROR(SendUp(std::move(ack)));
        } else {
          absl::StatusOr<LinkMessage> activation_or = runtime_->Forward(in.message);
          if (!activation_or.ok()) return RefusedFrom(in, activation_or.status());
          LinkMessage activation = *std::move(activation_or);
          RETURN_IF_ERROR(SendDown(std::move(activation)));
        }
        break;
      case v1::MESSAGE_KIND_EVAL_ACK:  // from downstream, on its way to stage 0
        RETURN_IF_ERROR(SendUp(in.message));
        break;
      case v1::MESSAGE_KIND_EVAL_END:
        if (runtime_->is_last()) {
          progress_->EvalFinished(header.step(), runtime_->TakeEvalResult(header.step()));
        } else {
          RETURN_IF_ERROR(SendDown(in.message));
        }
        break;
      case v1::MESSAGE_KIND_DONE: {
        // With replicas upstream each sends one (once); the last ends the
        // stage, and it ends nothing before the job's last step: this stage
        // must have finished every microbatch that is its to finish (a
        // replica, which sees only some ids, those up to the end of what the
        // upstream router sent it, which its DONE names). An early or
        // repeated one is a lie or a bug upstream, and costs the sender its
        // link. (A router that understates its end ends a replica early;
        // the last stage, unreplicated, still counts every microbatch.)
        const int64_t job_end = static_cast<int64_t>(job_.steps()) * job_.microbatches();
        done_end_ = std::max<int64_t>(
            done_end_, std::min<int64_t>(job_end, static_cast<int64_t>(header.microbatch())));
        // Every upstream's end, checked when the last DONE comes.
        const int64_t end = options_.replicated ? done_end_ : job_end;
        const int64_t reached = position_;
        const bool repeated = !in.peer.empty() && !done_from_.insert(in.peer).second;
        const bool last_done = dones_ + 1 >= options_.upstream_workers;
        if (repeated || (last_done && reached < end)) {
          failed_link_ = FailedLink::kUpstream;
          failed_peer_ = in.peer;
          return absl::UnavailableError(absl::StrCat(
              "DONE from ", in.peer.empty() ? "upstream" : in.peer, " refused: ",
              repeated ? "it sent one already"
                       : absl::StrCat("this stage is at microbatch ", position_, " of ", end)));
        }
        if (++dones_ < options_.upstream_workers) break;
        if (!runtime_->is_last()) RETURN_IF_ERROR(SendDown(in.message));
        return absl::OkStatus();
      }
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("unexpected message kind ", v1::MessageKind_Name(header.kind())));
    }
  }
}

void PipelineDriver::PublishStats() {
  if (stats_ == nullptr) return;
  last_published_ = absl::Now();
  const StashStats stash = runtime_->stash_stats();
  v1::StageStats stats;
  stats.set_schedule(ScheduleName(job_.schedule()));
  stats.set_weight_versions(stash.versions_alive);
  stats.set_max_weight_versions(stash.max_versions_alive);
  stats.set_weight_bytes(stash.bytes_alive);
  stats.set_staleness_max(stash.staleness_max);
  stats.set_staleness_mean(stash.staleness_mean);
  stats.set_microbatches(backwards_);
  stats.set_peak_rss_bytes(PeakResidentBytes());
  stats.set_dropped_microbatches(options_.dropped_microbatches);
  stats.set_weight_averages(weight_averages_);
  if (options_.outer != nullptr) {
    stats.set_outer_rounds(options_.outer->rounds_applied());
    stats.set_outer_bytes_sent(options_.outer->transport().bytes_sent());
    stats.set_outer_bytes_received(outer_bytes_received_);
  }
  if (options_.router != nullptr) {
    for (v1::RouteStats& route : options_.router->Stats()) *stats.add_routes() = std::move(route);
  }
  const Sample& first = samples_.front();
  const Sample& last = samples_.back();
  const double wall = absl::ToDoubleSeconds(last.time - first.time);
  const int64_t done = last.backwards - first.backwards;
  if (wall > 0) {
    const double idle = absl::ToDoubleSeconds(last.idle - first.idle);
    stats.set_bubble_fraction(std::clamp(idle / wall, 0.0, 1.0));
    stats.set_microbatches_per_s(done / wall);
  }
  const double compute_s = RecentComputeSeconds();
  stats.set_compute_s_per_microbatch(compute_s);
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start_);
  for (const auto& [link, direction, peer] :
       {std::tuple{&down_link_, "downstream", options_.downstream_peer},
        std::tuple{&up_link_, "upstream", options_.upstream_peer}}) {
    if (link->messages == 0 && link->bytes_received == 0) continue;
    v1::LinkStats* out = stats.add_links();
    out->set_peer(peer);
    out->set_direction(direction);
    out->set_codec(link->codec.empty() ? "none" : link->codec);
    out->set_bytes_sent(link->bytes);
    out->set_raw_bytes_sent(link->raw_bytes);
    out->set_messages_sent(link->messages);
    if (link->bytes > 0) {
      out->set_compression_ratio(static_cast<double>(link->raw_bytes) / link->bytes);
    }
    const double seconds = absl::ToDoubleSeconds(link->send_time);
    out->set_send_s(seconds);
    if (elapsed > 0) out->set_goodput_bps(8.0 * link->raw_bytes / elapsed);
    out->set_bytes_received(link->bytes_received);
    out->set_raw_bytes_received(link->raw_bytes_received);
    out->set_link_rate_bps(link->peer_rate_bps);
    if (link->received_norms.messages() > 0) {
      out->set_received_rms(link->received_norms.rms());
      out->set_received_measured(link->received_norms.messages());
      for (const StepRms& sample : link->received_norms.CompleteSamples()) {
        v1::StepRms* figure = out->add_received_rms_by_step();
        figure->set_step(sample.step);
        figure->set_rms(sample.rms);
        figure->set_messages(sample.messages);
      }
    }
    if (link->peer_rate_bps > 0) {
      out->set_link_s_per_microbatch(8 * link->wire_bytes_per_message / link->peer_rate_bps);
    }
    out->set_compute_s_per_microbatch(compute_s);
    out->set_adaptive(link->selector.has_value());
    const bool planned = options_.activation_codec != v1::CODEC_UNSPECIFIED ||
                         options_.gradient_codec != v1::CODEC_UNSPECIFIED;
    out->set_codec_reason(link->selector ? link->selector->reason()
                          : planned      ? "chosen by the plan for this link"
                                         : "fixed by the job");
  }
  stats_->Set(stats);
}

}  // namespace geotrain
