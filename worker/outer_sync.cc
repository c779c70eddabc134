#include "worker/outer_sync.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace geotrain {
namespace {

// A replica's contributions may run this many rounds ahead of the reducer
// (streaming); more is refused (each holds a stage's pseudo-gradient).
constexpr int kMaxRoundsAhead = 2;

}  // namespace

OuterSync::OuterSync(OuterSyncOptions options, int self_pipeline, std::set<int> pipelines,
                     OuterCompute* compute, OuterTransport* transport)
    : options_(options),
      self_(self_pipeline),
      pipelines_(std::move(pipelines)),
      compute_(compute),
      transport_(transport) {
  due_ = ended_ = applied_ = closed_ = RoundsEndedBy(options_.start_step);
  state_pending_ = options_.share_state && !reducer() && pipelines_.count(0) > 0;
}

absl::Status OuterSync::Start(absl::Time now) {
  if (!options_.share_state || !reducer()) return absl::OkStatus();
  for (int p : pipelines_) {
    if (p != self_) RETURN_IF_ERROR(SendState(p));
  }
  return absl::OkStatus();
}

absl::Status OuterSync::SendState(int to) {
  absl::StatusOr<std::vector<v1::LayerWeights>> state = compute_->ExportState();
  if (!state.ok()) return state.status();
  // Its round is the reducer's newest applied: the replica takes the means
  // after it.
  OuterMessage message = MessageOf(OuterMessage::Kind::kState, to, applied_, 0);
  message.layers = *std::move(state);
  return transport_->Send(to, std::move(message));
}

uint64_t OuterSync::EpochFor(int pipeline) const {
  auto it = options_.link_epochs.find(pipeline);
  return it == options_.link_epochs.end() ? options_.epoch : it->second;
}

absl::Status OuterSync::Leave(int pipeline, absl::Time now) {
  options_.link_epochs.erase(pipeline);
  if (!reducer()) {
    if (pipeline != 0) return absl::OkStatus();
    pipelines_.erase(0);
    detached_ = true;
    state_pending_ = false;
    pending_means_.clear();
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(Detach(pipeline, now));
  dropped_.erase(pipeline);  // it may come back, formed anew
  return absl::OkStatus();
}

absl::Status OuterSync::Attach(int pipeline, uint64_t link_epoch, absl::Time now) {
  if (pipeline == self_ || (!reducer() && pipeline != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline ", self_, " has no outer link with pipeline ", pipeline));
  }
  options_.link_epochs[pipeline] = link_epoch;
  pipelines_.insert(pipeline);
  dropped_.erase(pipeline);
  if (reducer()) return SendState(pipeline);
  // A new reducer: its state first.
  detached_ = false;
  state_pending_ = true;
  pending_means_.clear();
  return Advance(now);
}

int OuterSync::ScheduledRoundsEndedBy(int step) const {
  const int h = std::max(1, options_.inner_steps);
  const int offset =
      options_.streaming ? options_.stage * h / std::max(1, options_.stages) : 0;
  return step - offset <= 0 ? 0 : (step - offset) / h;
}

int OuterSync::final_round() const {
  return options_.final_step > 0 ? ScheduledRoundsEndedBy(options_.final_step - 1) + 1 : 0;
}

int OuterSync::RoundsEndedBy(int step) const {
  if (options_.final_step > 0 && step >= options_.final_step) return final_round();
  return ScheduledRoundsEndedBy(step);
}

std::optional<int> OuterSync::RoundEndingAt(int step) const {
  // Streaming: stage k syncs k/P of the way into the round (RoundsEndedBy).
  const int round = RoundsEndedBy(step);
  if (round == 0 || RoundsEndedBy(step - 1) == round) return std::nullopt;
  return round;
}

absl::Status OuterSync::AfterStep(int step, int64_t samples, absl::Time now) {
  const std::optional<int> round = RoundEndingAt(step);
  if (detached_ || !round.has_value() || *round <= due_) return absl::OkStatus();
  due_ = *round;
  due_samples_ = samples;
  if (reducer() && options_.streaming) {
    // The earlier rounds close now at the latest, so that their means are
    // applied before this round's pseudo-gradient is taken.
    for (auto& [earlier, open] : open_) {
      if (earlier < due_) open.deadline = std::min(open.deadline, now);
    }
    RETURN_IF_ERROR(CloseDue(now));
  }
  return Advance(now);
}

absl::Status OuterSync::Advance(absl::Time now) {
  RETURN_IF_ERROR(ApplyPending());
  // A round's pseudo-gradient is taken from the outer weights of the round
  // before: once that round's mean is applied (with streaming, it usually
  // came during this round's inner steps).
  if (detached_ || state_pending_ || due_ <= ended_ || applied_ < due_ - 1) {
    return absl::OkStatus();
  }
  const int round = due_;
  absl::StatusOr<std::vector<v1::LayerWeights>> delta = compute_->ExportPseudoGradient();
  if (!delta.ok()) return delta.status();
  ended_ = round;
  last_sent_bytes_ = 0;
  for (const v1::LayerWeights& layer : *delta) last_sent_bytes_ += layer.ByteSizeLong();
  if (reducer()) {
    Round& r = open_[round];
    r.contributions[self_] = {self_, due_samples_, *std::move(delta)};
    // Blocking: the others have `deadline` from now, plus the time a
    // pseudo-gradient of this size takes at the pace (a large stage's
    // would otherwise miss every round on a thin uplink). Streaming: until
    // this replica's next round ends, so nobody waits for the network; the
    // final round is blocking in either mode.
    const absl::Duration allowance = TransferTime(last_sent_bytes_);
    r.deadline = options_.streaming && round != final_round()
                     ? absl::InfiniteFuture()
                     : now + options_.deadline + allowance;
    RETURN_IF_ERROR(CloseDue(now));
    if (open_.count(round) > 0 && r.contributions.size() == pipelines_.size()) {
      RETURN_IF_ERROR(Close(round));
    }
    return absl::OkStatus();
  }
  OuterMessage message = MessageOf(OuterMessage::Kind::kDelta, 0, round, due_samples_);
  message.layers = *std::move(delta);
  RETURN_IF_ERROR(transport_->Send(0, std::move(message)));
  return ApplyPending();
}

absl::Status OuterSync::OnMessage(const OuterMessage& message, absl::Time now) {
  auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("outer sync message from pipeline ",
                                                   message.pipeline, " refused: ", why));
  };
  if (message.epoch != EpochFor(message.pipeline) || message.stage != options_.stage) {
    return refuse("another epoch or stage");
  }
  // What was in flight on a link that since broke.
  if (detached_ || dropped_.count(message.pipeline) > 0) return absl::OkStatus();
  if (message.pipeline == self_ || pipelines_.count(message.pipeline) == 0) {
    return refuse("not a replica of this stage in the plan");
  }
  if (message.kind == OuterMessage::Kind::kState) {
    if (message.pipeline != 0 || reducer()) return refuse("a state not from the reducer");
    if (!state_pending_) return refuse("a second state");
    RETURN_IF_ERROR(compute_->AdoptState(message.layers, message.round));
    state_pending_ = false;
    // The reducer's rounds from here on: a replica that joined after some
    // (or is ahead of them) takes the means after the state's round, and
    // sends nothing for a round it had counted as ended.
    applied_ = message.round;
    ended_ = std::max(ended_, applied_);
    due_ = std::max(due_, applied_);
    pending_means_.erase(pending_means_.begin(), pending_means_.upper_bound(applied_));
    return Advance(now);
  }
  if (message.round < 1) return refuse("round before the first");
  if (message.kind == OuterMessage::Kind::kDelta) {
    if (!reducer()) return refuse("a contribution to a replica that does not reduce");
    if (message.samples < 0) return refuse("negative samples");
    if (message.round <= closed_) return absl::OkStatus();  // too late: round closed
    if (message.round > ended_ + kMaxRoundsAhead) return refuse("too many rounds ahead");
    Round& r = open_[message.round];
    if (r.contributions.count(message.pipeline) > 0) return refuse("a second contribution");
    r.contributions[message.pipeline] = {message.pipeline, message.samples, message.layers};
    if (message.round <= ended_ && r.contributions.size() == pipelines_.size()) {
      RETURN_IF_ERROR(Close(message.round));
    }
    return OnTime(now);
  }
  if (message.pipeline != 0 || reducer()) return refuse("a mean not from the reducer");
  if (message.round <= applied_ || pending_means_.count(message.round) > 0) {
    return refuse("a mean for a round already applied");
  }
  // Means come in order on one link and are applied as they come: only a
  // broken reducer sends one out of order, and nobody keeps many.
  if (message.round > applied_ + kMaxRoundsAhead) return refuse("a mean out of order");
  for (int p : message.contributors) {
    if (pipelines_.count(p) == 0) return refuse("a contributor not in the plan");
  }
  pending_means_[message.round] = message;
  return Advance(now);
}

absl::Status OuterSync::Detach(int pipeline, absl::Time now) {
  if (pipeline == self_ || pipelines_.count(pipeline) == 0) return absl::OkStatus();
  if (!reducer()) {
    if (pipeline != 0) return absl::OkStatus();
    detached_ = true;
    state_pending_ = false;
    pending_means_.clear();
    return absl::OkStatus();
  }
  pipelines_.erase(pipeline);
  dropped_.insert(pipeline);
  // Rounds that waited only for it are complete now.
  std::vector<int> complete;
  for (auto& [round, r] : open_) {
    r.contributions.erase(pipeline);
    if (round <= ended_ && r.contributions.size() == pipelines_.size()) complete.push_back(round);
  }
  for (int round : complete) {
    if (open_.count(round) > 0) RETURN_IF_ERROR(Close(round));
  }
  return OnTime(now);  // and a waiting export may go on
}

absl::Status OuterSync::OnTime(absl::Time now) {
  RETURN_IF_ERROR(CloseDue(now));
  return Advance(now);
}

absl::Status OuterSync::CloseDue(absl::Time now) {
  while (!open_.empty()) {
    const int round = open_.begin()->first;
    // A round closes only once this replica (the reducer) has contributed.
    if (round > ended_ || open_.begin()->second.deadline > now) break;
    RETURN_IF_ERROR(Close(round));
  }
  return absl::OkStatus();
}

absl::Status OuterSync::Close(int round) {
  auto it = open_.find(round);
  if (it == open_.end()) return absl::InternalError(absl::StrCat("round ", round, " not open"));
  // Earlier rounds first: means are applied in order.
  while (open_.begin()->first < round) RETURN_IF_ERROR(Close(open_.begin()->first));
  std::vector<OuterCompute::Contribution> contributions;
  std::vector<int> contributors;
  int64_t samples = 0;
  for (auto& [pipeline, c] : it->second.contributions) {  // in pipeline order
    contributors.push_back(pipeline);
    samples += c.samples;
    contributions.push_back(std::move(c));
  }
  open_.erase(it);
  closed_ = round;
  absl::StatusOr<std::vector<v1::LayerWeights>> mean = compute_->Reduce(contributions);
  if (!mean.ok()) return mean.status();
  for (int p : pipelines_) {
    if (p == self_) continue;
    OuterMessage message = MessageOf(OuterMessage::Kind::kMean, p, round, samples);
    message.contributors = contributors;
    message.layers = *mean;
    RETURN_IF_ERROR(transport_->Send(p, std::move(message)));
  }
  return Apply(round, *mean, std::move(contributors));
}

OuterMessage OuterSync::MessageOf(OuterMessage::Kind kind, int to, int round,
                                  int64_t samples) const {
  OuterMessage message;
  message.kind = kind;
  message.epoch = EpochFor(to);
  message.stage = options_.stage;
  message.round = round;
  message.pipeline = self_;
  message.samples = samples;
  return message;
}

absl::Status OuterSync::Apply(int round, const std::vector<v1::LayerWeights>& mean,
                              std::vector<int> contributors) {
  if (round != applied_ + 1) {
    return absl::InternalError(absl::StrCat("round ", round, "'s mean after round ", applied_));
  }
  // The final round leaves every replica on the outer weights, a replica
  // whose own contribution missed it included.
  RETURN_IF_ERROR(compute_->ApplyMean(
      mean, /*keep_local_progress=*/options_.streaming && round != final_round()));
  applied_ = round;
  members_[round] = std::move(contributors);
  return absl::OkStatus();
}

absl::Status OuterSync::ApplyPending() {
  while (!pending_means_.empty()) {
    auto it = pending_means_.begin();
    // In order. A mean for a round this replica has not ended means it
    // trails the others (its contribution missed the round): it takes the
    // mean at once, catching up to the outer weights, and ends that round
    // without a pseudo-gradient of its own.
    if (it->first != applied_ + 1) break;
    OuterMessage mean = std::move(it->second);
    pending_means_.erase(it);
    if (mean.round > ended_) {
      ended_ = mean.round;
      due_ = std::max(due_, mean.round);
    }
    RETURN_IF_ERROR(Apply(mean.round, mean.layers, std::move(mean.contributors)));
  }
  return absl::OkStatus();
}

bool OuterSync::MustWait() const {
  if (detached_) return false;
  return due_ > ended_ ||
         (ended_ > applied_ && (!options_.streaming || ended_ == final_round()));
}

bool OuterSync::finished() const {
  return detached_ || (options_.final_step > 0 && applied_ >= final_round());
}

absl::Duration OuterSync::TransferTime(uint64_t bytes) const {
  if (!options_.transfer_time) return absl::ZeroDuration();
  return std::max(absl::ZeroDuration(), options_.transfer_time(bytes));
}

absl::Duration OuterSync::WaitAllowance() const {
  const int others = std::max<int>(1, static_cast<int>(pipelines_.size()) - 1);
  const uint64_t down = state_pending_ ? options_.state_bytes : last_sent_bytes_;
  return TransferTime(last_sent_bytes_) + options_.deadline + TransferTime(down) * others;
}

absl::Time OuterSync::NextDeadline() const {
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [round, r] : open_) {
    if (round <= ended_) next = std::min(next, r.deadline);
  }
  return next;
}

}  // namespace geotrain
