#include "worker/tied_gradient_exchange.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/rpc_options.h"

namespace geotrain {
namespace {

grpc::Status Refuse(grpc::StatusCode code, const std::string& why) {
  GT_LOG(Warning) << "refused a tied-embedding gradient: " << why;
  return grpc::Status(code, why);
}

}  // namespace

TiedGradientExchange::TiedGradientExchange(absl::Duration push_deadline,
                                           double min_push_bytes_per_second,
                                           absl::Duration wait_limit)
    : push_deadline_(push_deadline),
      min_push_bytes_per_second_(min_push_bytes_per_second),
      wait_limit_(wait_limit) {}

void TiedGradientExchange::Activate(Target target) {
  absl::MutexLock lock(&mu_);
  target_ = std::move(target);
  ++activations_;
  received_.clear();
  last_taken_ = -1;
}

void TiedGradientExchange::Deactivate() {
  absl::MutexLock lock(&mu_);
  target_.reset();
  ++activations_;
  received_.clear();
  last_taken_ = -1;
}

absl::StatusOr<std::string> TiedGradientExchange::Exchange(int64_t update,
                                                           std::string_view mine) {
  Target target;
  uint64_t activation = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!target_.has_value()) {
      return absl::FailedPreconditionError("no tied-embedding peer in this plan");
    }
    target = *target_;
    activation = activations_;
  }
  if (mine.size() != target.gradient_bytes) {
    return absl::InternalError(absl::StrCat("the tied embedding's gradient is ", mine.size(),
                                            " bytes, not ", target.gradient_bytes));
  }
  const std::string peer = absl::StrCat("'", target.peer_id, "' (stage ", target.peer_stage,
                                        ", ", target.peer_address, ")");
  if (const grpc::Status sent = Send(target, update, mine); !sent.ok()) {
    return absl::UnavailableError(absl::StrCat("the tied embedding's gradient could not be sent to ",
                                               peer, ": ", sent.error_message()));
  }
  absl::MutexLock lock(&mu_);
  auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return activations_ != activation || received_.count(update) > 0;
  };
  mu_.AwaitWithTimeout(absl::Condition(&arrived), wait_limit_);
  if (activations_ != activation) {
    return absl::AbortedError("the plan changed during the tied-embedding exchange");
  }
  auto it = received_.find(update);
  if (it == received_.end()) {
    return absl::UnavailableError(absl::StrCat(peer, " sent no tied-embedding gradient for update ",
                                               update, " within ",
                                               absl::FormatDuration(wait_limit_)));
  }
  std::string theirs = std::move(it->second);
  received_.erase(received_.begin(), std::next(it));
  last_taken_ = update;
  return theirs;
}

grpc::Status TiedGradientExchange::Send(const Target& target, int64_t update,
                                        std::string_view mine) {
  if (stub_ == nullptr || stub_address_ != target.peer_address) {
    stub_ = v1::TiedEmbedding::NewStub(
        MakeSecureChannel(target.peer_address, security_, target.peer_id));
    stub_address_ = target.peer_address;
  }
  grpc::ClientContext context;
  const absl::Duration deadline =
      push_deadline_ + absl::Seconds(static_cast<double>(mine.size()) / min_push_bytes_per_second_);
  context.set_deadline(
      DeadlineFromNow(std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline))));
  v1::PushTiedGradientResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::TiedGradientPart>> writer =
      stub_->PushGradient(&context, &response);
  v1::TiedGradientPart part;
  part.set_epoch(target.epoch);
  part.set_from_stage(target.stage);
  part.set_from_worker(target.self_id);
  part.set_update(update);
  part.set_total_bytes(mine.size());
  size_t offset = 0;
  do {  // at least one part, even for an empty matrix
    const size_t take = std::min(kStreamPartBytes, mine.size() - offset);
    part.set_offset(offset);
    part.set_data(mine.data() + offset, take);
    if (!writer->Write(part)) break;
    offset += take;
  } while (offset < mine.size());
  writer->WritesDone();
  return writer->Finish();
}

grpc::Status TiedGradientExchange::PushGradient(grpc::ServerContext* context,
                                                grpc::ServerReader<v1::TiedGradientPart>* reader,
                                                v1::PushTiedGradientResponse* response) {
  v1::TiedGradientPart part;
  if (!reader->Read(&part)) return Refuse(grpc::StatusCode::INVALID_ARGUMENT, "an empty push");
  Target target;
  uint64_t activation = 0;
  int64_t last_taken = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!target_.has_value()) {
      return Refuse(grpc::StatusCode::FAILED_PRECONDITION,
                    "this worker holds no tied embedding in its plan");
    }
    target = *target_;
    activation = activations_;
    last_taken = last_taken_;
  }
  const v1::TiedGradientPart first = part;
  if (first.epoch() != target.epoch || first.from_stage() != target.peer_stage ||
      first.from_worker() != target.peer_id) {
    return Refuse(grpc::StatusCode::PERMISSION_DENIED,
                  absl::StrCat("a gradient from '", first.from_worker().substr(0, 128),
                               "' (stage ", first.from_stage(), ", epoch ", first.epoch(),
                               "); this worker exchanges with '", target.peer_id, "' (stage ",
                               target.peer_stage, ") in epoch ", target.epoch));
  }
  if (!security_.insecure && PeerIdentity(*context) != first.from_worker()) {
    return Refuse(grpc::StatusCode::PERMISSION_DENIED,
                  absl::StrCat("a gradient from '", first.from_worker().substr(0, 128),
                               "' pushed by a peer whose certificate names '",
                               PeerIdentity(*context), "'"));
  }
  if (first.total_bytes() != target.gradient_bytes) {
    return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("a gradient of ", first.total_bytes(), " bytes; the tied matrix has ",
                               target.gradient_bytes));
  }
  if (first.update() <= last_taken) {
    return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("update ", first.update(), " is not after update ", last_taken,
                               ", the last one taken"));
  }
  std::string data;
  data.reserve(target.gradient_bytes);  // exact, and bounded by the model
  do {
    if (part.epoch() != first.epoch() || part.from_stage() != first.from_stage() ||
        part.from_worker() != first.from_worker() || part.update() != first.update() ||
        part.total_bytes() != first.total_bytes()) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    "a part names another epoch, sender, update or size than the first");
    }
    if (part.offset() != data.size() || part.data().size() > target.gradient_bytes - data.size()) {
      return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("a part of ", part.data().size(), " bytes at byte ", part.offset(),
                                 " where byte ", data.size(), " of ", target.gradient_bytes,
                                 " was due"));
    }
    data.append(part.data());
  } while (reader->Read(&part));
  if (data.size() != target.gradient_bytes) {
    return Refuse(grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("the push ended at byte ", data.size(), " of ",
                               target.gradient_bytes));
  }
  absl::MutexLock lock(&mu_);
  if (activations_ != activation) {
    return Refuse(grpc::StatusCode::FAILED_PRECONDITION,
                  "the plan changed while the gradient was arriving");
  }
  if (received_.count(first.update()) > 0 || received_.size() >= 2) {
    return Refuse(grpc::StatusCode::RESOURCE_EXHAUSTED,
                  absl::StrCat("update ", first.update(),
                               " came again, or more than one update ahead of this end"));
  }
  received_[first.update()] = std::move(data);
  return grpc::Status::OK;
}

}  // namespace geotrain
