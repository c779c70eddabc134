#include "worker/outer_links.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace geotrain {

LinkMessage ToLinkMessage(const OuterMessage& message, int stage) {
  LinkMessage out;
  v1::LinkHeader& h = out.header;
  switch (message.kind) {
    case OuterMessage::Kind::kDelta: h.set_kind(v1::MESSAGE_KIND_OUTER_DELTA); break;
    case OuterMessage::Kind::kMean: h.set_kind(v1::MESSAGE_KIND_OUTER_MEAN); break;
    case OuterMessage::Kind::kState: h.set_kind(v1::MESSAGE_KIND_OUTER_STATE); break;
  }
  h.set_epoch(message.epoch);
  h.set_from_stage(stage);
  v1::OuterHeader& outer = *h.mutable_outer();
  outer.set_round(message.round);
  outer.set_pipeline(message.pipeline);
  outer.set_samples(message.samples);
  for (int c : message.contributors) outer.add_contributors(c);
  size_t bytes = 0;
  for (const v1::LayerWeights& layer : message.layers) bytes += layer.payload().size();
  out.payload.reserve(bytes);
  for (const v1::LayerWeights& layer : message.layers) {
    v1::OuterLayer& entry = *outer.add_layers();
    entry.set_layer(layer.layer());
    entry.set_params(layer.params_size());
    for (const v1::TensorHeader& t : layer.params()) *h.add_tensors() = t;
    out.payload.append(layer.payload());
  }
  return out;
}

absl::StatusOr<OuterMessage> FromLinkMessage(const LinkMessage& message) {
  const v1::LinkHeader& h = message.header;
  OuterMessage out;
  switch (h.kind()) {
    case v1::MESSAGE_KIND_OUTER_DELTA: out.kind = OuterMessage::Kind::kDelta; break;
    case v1::MESSAGE_KIND_OUTER_MEAN: out.kind = OuterMessage::Kind::kMean; break;
    case v1::MESSAGE_KIND_OUTER_STATE: out.kind = OuterMessage::Kind::kState; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("not an outer message: ", v1::MessageKind_Name(h.kind())));
  }
  out.epoch = h.epoch();
  out.stage = h.from_stage();
  out.round = h.outer().round();
  out.pipeline = h.outer().pipeline();
  out.samples = h.outer().samples();
  out.contributors.assign(h.outer().contributors().begin(), h.outer().contributors().end());
  int tensor = 0;
  size_t offset = 0;
  for (const v1::OuterLayer& entry : h.outer().layers()) {
    v1::LayerWeights& layer = out.layers.emplace_back();
    layer.set_layer(entry.layer());
    size_t bytes = 0;
    for (int p = 0; p < entry.params(); ++p, ++tensor) {
      if (tensor >= h.tensors_size()) {
        return absl::InvalidArgumentError("an outer message lists more tensors than it has");
      }
      *layer.add_params() = h.tensors(tensor);
      bytes += h.tensors(tensor).payload_bytes();
    }
    if (message.payload.size() - offset < bytes) {
      return absl::InvalidArgumentError("an outer message's payload is shorter than its tensors");
    }
    layer.set_payload(message.payload.substr(offset, bytes));
    offset += bytes;
  }
  if (tensor != h.tensors_size() || offset != message.payload.size()) {
    return absl::InvalidArgumentError("an outer message's tensors and layers disagree");
  }
  return out;
}

OuterLinks::OuterLinks(std::map<int, std::shared_ptr<PipelineLink>> links, int stage,
                       std::shared_ptr<SendPacer> pacer)
    : links_(std::move(links)), stage_(stage), pacer_(std::move(pacer)) {
  if (pacer_ != nullptr) {
    for (auto& [pipeline, link] : links_) link->PaceSends(pacer_);
  }
  sender_ = std::thread([this] { SendLoop(); });
}

OuterLinks::~OuterLinks() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    queue_.clear();
  }
  sender_.join();
}

absl::Status OuterLinks::Send(int to, OuterMessage message) {
  absl::MutexLock lock(&mu_);
  if (links_.count(to) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("no outer link to pipeline ", to, " on stage ", stage_));
  }
  if (stopping_) return absl::CancelledError("the session is ending");
  queue_.emplace_back(to, std::move(message));
  return absl::OkStatus();
}

void OuterLinks::Flush() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || (queue_.empty() && !sending_);
  };
  mu_.Await(absl::Condition(&idle));
}

std::shared_ptr<PipelineLink> OuterLinks::Remove(int pipeline) {
  absl::MutexLock lock(&mu_);
  auto it = links_.find(pipeline);
  if (it == links_.end()) return nullptr;
  std::shared_ptr<PipelineLink> link = std::move(it->second);
  links_.erase(it);
  // What was queued for it goes nowhere now.
  for (auto q = queue_.begin(); q != queue_.end();) {
    q = q->first == pipeline ? queue_.erase(q) : std::next(q);
  }
  return link;
}

void OuterLinks::Attach(int pipeline, std::shared_ptr<PipelineLink> link) {
  if (pacer_ != nullptr) link->PaceSends(pacer_);
  absl::MutexLock lock(&mu_);
  links_[pipeline] = std::move(link);
}

uint64_t OuterLinks::bytes_sent() const {
  absl::MutexLock lock(&mu_);
  return bytes_sent_;
}

void OuterLinks::SendLoop() {
  while (true) {
    std::pair<int, OuterMessage> next;
    std::shared_ptr<PipelineLink> link;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      sending_ = true;
      link = links_.at(next.first);  // Send() queues only for a link it has
    }
    LinkMessage message = ToLinkMessage(next.second, stage_);
    const uint64_t bytes = message.payload.size();
    const absl::Status sent = link->Send(std::move(message));
    if (!sent.ok()) {
      GT_LOG(Warning) << "outer round " << next.second.round << " to pipeline " << next.first
                      << " not sent: " << sent.message();
    }
    absl::MutexLock lock(&mu_);
    sending_ = false;
    if (sent.ok()) bytes_sent_ += bytes;
  }
}

absl::StatusOr<std::vector<v1::LayerWeights>> RuntimeOuterCompute::Reduce(
    const std::vector<Contribution>& contributions) {
  std::vector<StageRuntime::OuterContribution> converted;
  converted.reserve(contributions.size());
  for (const Contribution& c : contributions) {
    converted.push_back({c.pipeline, c.samples, c.layers});
  }
  return runtime_->ReduceOuterContributions(converted);
}

absl::StatusOr<std::vector<v1::LayerWeights>> RuntimeOuterCompute::ExportState() {
  return runtime_->ExportOuterState();
}

absl::Status RuntimeOuterCompute::AdoptState(const std::vector<v1::LayerWeights>& state,
                                             int64_t rounds) {
  return runtime_->AdoptOuterState(state, rounds);
}

}  // namespace geotrain
