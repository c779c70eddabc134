#include "worker/link_validator.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/commitment.h"
#include "common/model_profile.h"
#include "common/status_macros.h"

namespace geotrain {
namespace {

// A zstd'd tensor's frame must declare the encoded size its header
// announces, so the runtime never decodes more than the message's bound.
absl::Status CheckZstdFrame(const v1::TensorHeader& header, const std::string& payload,
                            size_t offset) {
  if (!header.zstd()) return absl::OkStatus();
  if (offset > payload.size() || payload.size() - offset < header.payload_bytes()) {
    return absl::InvalidArgumentError("zstd'd tensor runs past the payload");
  }
  return CheckZstdFrameHeader(absl::string_view(payload).substr(offset, header.payload_bytes()),
                              header.encoded_bytes());
}

}  // namespace

LinkValidator::LinkValidator(const v1::JobSpec& job, uint64_t epoch, int stage,
                             int layer_begin, int layer_end,
                             std::set<std::string> upstream_workers,
                             std::set<std::string> replica_peers,
                             std::map<std::string, uint64_t> replica_link_epochs)
    : job_(job),
      epoch_(epoch),
      stage_(stage),
      layer_begin_(layer_begin),
      layer_end_(layer_end),
      upstream_workers_(std::move(upstream_workers)),
      replica_peers_(std::move(replica_peers)),
      replica_link_epochs_(std::move(replica_link_epochs)) {}

uint64_t LinkValidator::ReplicaLinkEpoch(const std::string& peer) const {
  auto it = replica_link_epochs_.find(peer);
  return it == replica_link_epochs_.end() ? epoch_ : it->second;
}

std::shared_ptr<const LinkValidator> LinkValidator::ForReplicaLink(const std::string& peer) const {
  auto link = std::make_shared<LinkValidator>(*this);
  link->epoch_ = ReplicaLinkEpoch(peer);
  link->replica_peers_ = {peer};
  link->replica_link_epochs_.clear();
  return link;
}

absl::Status LinkValidator::CheckEpoch(const v1::LinkHeader& header) const {
  if (header.epoch() != epoch_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "message of plan epoch ", header.epoch(), " refused: this stage runs epoch ",
        epoch_));
  }
  return absl::OkStatus();
}

absl::Status LinkValidator::CheckHelloEpoch(const v1::LinkHeader& hello) const {
  if (hello.kind() != v1::MESSAGE_KIND_HELLO) {
    return absl::InvalidArgumentError("a link stream must open with HELLO");
  }
  if (hello.epoch() > epoch_) {
    // The dialler saw the new plan first; this worker will shortly.
    return absl::FailedPreconditionError(absl::StrCat(
        "HELLO of plan epoch ", hello.epoch(), ": this worker has not started it yet (on ",
        epoch_, ")"));
  }
  return CheckEpoch(hello);
}

absl::Status LinkValidator::CheckHelloFromDownstream(
    const v1::LinkHeader& hello, const std::set<std::string>& dialling_downstream,
    const std::string& self_id) const {
  RETURN_IF_ERROR(CheckHelloEpoch(hello));
  if (hello.from_stage() != stage_ + 1) {
    return absl::InvalidArgumentError(absl::StrCat("HELLO from stage ", hello.from_stage(),
                                                   ": not a neighbour of stage ", stage_));
  }
  if (dialling_downstream.count(hello.from_worker()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HELLO from worker '", hello.from_worker().substr(0, 128), "', which the plan of epoch ",
        epoch_, " does not have dial stage ", stage_, " from stage ", stage_ + 1));
  }
  if (hello.to_worker() != self_id) {
    return absl::InvalidArgumentError(absl::StrCat("HELLO for worker '",
                                                   hello.to_worker().substr(0, 128),
                                                   "' reached ", self_id));
  }
  return absl::OkStatus();
}

absl::Status LinkValidator::CheckHello(const v1::LinkHeader& hello) const {
  RETURN_IF_ERROR(CheckHelloEpoch(hello));
  if (stage_ == 0) {
    return absl::InvalidArgumentError("stage 0 has no upstream and accepts no links");
  }
  if (hello.from_stage() != stage_ - 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HELLO from stage ", hello.from_stage(), " but stage ", stage_,
        " accepts links only from stage ", stage_ - 1));
  }
  // Every HELLO names its worker: an anonymous link could not be told
  // apart from its legitimate twin (and with TLS the name is certified).
  if (!upstream_workers_.empty() && upstream_workers_.count(hello.from_worker()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HELLO from worker '", hello.from_worker(), "', which the plan of epoch ", epoch_,
        " does not put on stage ", stage_ - 1));
  }
  return absl::OkStatus();
}

absl::Status LinkValidator::CheckHeaderFromUpstream(const v1::LinkHeader& h) const {
  RETURN_IF_ERROR(CheckEpoch(h));
  switch (h.kind()) {
    case v1::MESSAGE_KIND_ACTIVATION:
    case v1::MESSAGE_KIND_EVAL: {
      if (h.tensors_size() != 2) {
        return absl::InvalidArgumentError(absl::StrCat(
            "activation message with ", h.tensors_size(), " tensors; expected 2"));
      }
      const int64_t batch = job_.microbatch_size();
      RETURN_IF_ERROR(CheckTensorMatches(
          h.tensors(0), LayerInputSpec(job_, layer_begin_, batch), "activation"));
      RETURN_IF_ERROR(CheckTensorMatches(h.tensors(1), TargetSpec(job_, batch), "targets"));
      if (h.tensors(0).shape(0) != h.tensors(1).shape(0)) {
        return absl::InvalidArgumentError("activation and targets differ in batch size");
      }
      return absl::OkStatus();
    }
    case v1::MESSAGE_KIND_EVAL_END:
    case v1::MESSAGE_KIND_DONE:
      if (h.tensors_size() != 0) {
        return absl::InvalidArgumentError("control message carries tensors");
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "message kind ", v1::MessageKind_Name(h.kind()), " may not flow downstream"));
  }
}

absl::Status LinkValidator::CheckHeaderFromDownstream(const v1::LinkHeader& h) const {
  RETURN_IF_ERROR(CheckEpoch(h));
  if (h.kind() == v1::MESSAGE_KIND_EVAL_ACK) {
    if (h.tensors_size() != 0) {
      return absl::InvalidArgumentError("an evaluation acknowledgement carries no tensor");
    }
    return absl::OkStatus();
  }
  if (h.kind() != v1::MESSAGE_KIND_GRADIENT) {
    return absl::InvalidArgumentError(absl::StrCat(
        "message kind ", v1::MessageKind_Name(h.kind()), " may not flow upstream"));
  }
  if (h.tensors_size() != 1) {
    return absl::InvalidArgumentError("gradient message must carry one tensor");
  }
  return CheckTensorMatches(h.tensors(0),
                            LayerInputSpec(job_, layer_end_, job_.microbatch_size()), "gradient");
}

absl::Status LinkValidator::CheckFromUpstream(const LinkMessage& message) const {
  const v1::LinkHeader& h = message.header;
  RETURN_IF_ERROR(CheckHeaderFromUpstream(h));
  RETURN_IF_ERROR(CheckCommitment(h, message.payload));
  switch (h.kind()) {
    case v1::MESSAGE_KIND_ACTIVATION:
    case v1::MESSAGE_KIND_EVAL: {
      // Encoded or zstd'd activations are checked for finiteness once decoded
      // (DecodeTensor); raw ones here, and a zstd frame's declared size
      // before anything decodes it.
      RETURN_IF_ERROR(CheckFinite(h.tensors(0), message.payload, 0));
      RETURN_IF_ERROR(CheckZstdFrame(h.tensors(0), message.payload, 0));
      // Targets index the loss: a label out of range would fail inside it.
      // zstd'd targets are unpacked here, within the size their header
      // announces (CheckTensorMatches has tied that to the shape).
      absl::string_view targets(message.payload.data() + h.tensors(0).payload_bytes(),
                                h.tensors(1).payload_bytes());
      std::string unpacked;
      if (h.tensors(1).zstd()) {
        ASSIGN_OR_RETURN(unpacked, ZstdDecompress(targets, h.tensors(1).encoded_bytes()));
        if (unpacked.size() != h.tensors(1).encoded_bytes()) {
          return absl::InvalidArgumentError("zstd'd targets do not hold the announced bytes");
        }
        targets = unpacked;
      }
      const int64_t classes = NumTargetClasses(job_);
      for (size_t i = 0; i < targets.size() / 8; ++i) {
        int64_t label;
        std::memcpy(&label, targets.data() + 8 * i, 8);
        if (label < 0 || label >= classes) {
          return absl::InvalidArgumentError(absl::StrCat("target ", label, " outside [0, ",
                                                         classes, ")"));
        }
      }
      return absl::OkStatus();
    }
    default:
      return absl::OkStatus();  // control messages: the header is all
  }
}

absl::Status LinkValidator::CheckHelloFromReplica(const v1::LinkHeader& hello,
                                                  const std::string& self_id) const {
  if (replica_peers_.count(hello.from_worker()) > 0) {
    RETURN_IF_ERROR(ForReplicaLink(hello.from_worker())->CheckHelloEpoch(hello));
  } else {
    RETURN_IF_ERROR(CheckHelloEpoch(hello));
  }
  if (hello.from_stage() != stage_) {
    return absl::InvalidArgumentError(absl::StrCat("HELLO from stage ", hello.from_stage(),
                                                   ": not a replica of stage ", stage_));
  }
  if (replica_peers_.count(hello.from_worker()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HELLO from worker '", hello.from_worker().substr(0, 128), "', which the plan of epoch ",
        epoch_, " does not link with this one for the outer sync of stage ", stage_));
  }
  if (hello.to_worker() != self_id) {
    return absl::InvalidArgumentError(absl::StrCat("HELLO for worker '",
                                                   hello.to_worker().substr(0, 128),
                                                   "' reached ", self_id));
  }
  return absl::OkStatus();
}

absl::Status LinkValidator::CheckHeaderFromReplica(const v1::LinkHeader& h) const {
  RETURN_IF_ERROR(CheckEpoch(h));
  const bool state = h.kind() == v1::MESSAGE_KIND_OUTER_STATE;
  if (h.kind() != v1::MESSAGE_KIND_OUTER_DELTA && h.kind() != v1::MESSAGE_KIND_OUTER_MEAN &&
      !state) {
    return absl::InvalidArgumentError(absl::StrCat(
        "message kind ", v1::MessageKind_Name(h.kind()), " may not flow between replicas"));
  }
  if (!h.has_outer()) return absl::InvalidArgumentError("an outer message without its header");
  const v1::OuterHeader& outer = h.outer();
  if (outer.round() < (state ? 0 : 1) || outer.samples() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("outer message of round ", outer.round(),
                                                   " with ", outer.samples(), " samples"));
  }
  // A state lists the stage's layers once (its outer weights) or twice
  // (then its momentum).
  const int layers = layer_end_ - layer_begin_;
  if (outer.layers_size() != layers && !(state && outer.layers_size() == 2 * layers)) {
    return absl::InvalidArgumentError(absl::StrCat("outer message with ", outer.layers_size(),
                                                   " layers; stage ", stage_, " has ", layers));
  }
  int tensor = 0;
  for (int i = 0; i < outer.layers_size(); ++i) {
    const int layer = layer_begin_ + i % layers;
    if (outer.layers(i).layer() != layer) {
      return absl::InvalidArgumentError(absl::StrCat("outer message lists layer ",
                                                     outer.layers(i).layer(), " where ", layer,
                                                     " belongs"));
    }
    const std::vector<ParameterSpec> params = LayerParameters(job_, layer);
    if (outer.layers(i).params() != static_cast<int>(params.size()) ||
        h.tensors_size() - tensor < static_cast<int>(params.size())) {
      return absl::InvalidArgumentError(absl::StrCat("outer message gives layer ", layer, " ",
                                                     outer.layers(i).params(),
                                                     " tensors; the model has ", params.size()));
    }
    for (const ParameterSpec& param : params) {
      const v1::TensorHeader& t = h.tensors(tensor++);
      RETURN_IF_ERROR(CheckTensorMatches(t, TensorSpec{param.shape}, param.name.c_str()));
      if (!param.shape.empty() && t.shape(0) != param.shape[0]) {
        return absl::InvalidArgumentError(absl::StrCat(param.name, " of layer ", layer,
                                                       " has dimension 0 of ", t.shape(0),
                                                       ", the model ", param.shape[0]));
      }
    }
  }
  if (tensor != h.tensors_size()) {
    return absl::InvalidArgumentError(absl::StrCat("outer message with ", h.tensors_size(),
                                                   " tensors; stage ", stage_, " has ", tensor));
  }
  return absl::OkStatus();
}

absl::Status LinkValidator::CheckFromReplica(const LinkMessage& message) const {
  RETURN_IF_ERROR(CheckHeaderFromReplica(message.header));
  size_t offset = 0;
  for (const v1::TensorHeader& t : message.header.tensors()) {
    RETURN_IF_ERROR(CheckZstdFrame(t, message.payload, offset));
    RETURN_IF_ERROR(CheckFinite(t, message.payload, offset));
    offset += t.payload_bytes();
  }
  return absl::OkStatus();
}

absl::Status LinkValidator::CheckFromDownstream(const LinkMessage& message) const {
  RETURN_IF_ERROR(CheckHeaderFromDownstream(message.header));
  RETURN_IF_ERROR(CheckCommitment(message.header, message.payload));
  if (message.header.kind() == v1::MESSAGE_KIND_EVAL_ACK) {
    if (!message.payload.empty()) {
      return absl::InvalidArgumentError("an evaluation acknowledgement carries no payload");
    }
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(CheckZstdFrame(message.header.tensors(0), message.payload, 0));
  return CheckFinite(message.header.tensors(0), message.payload, 0);
}

}  // namespace geotrain
