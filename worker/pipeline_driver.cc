#include "worker/pipeline_driver.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace geotrain {

PipelineDriver::PipelineDriver(const v1::JobSpec& job,
                               const PipelineDriverOptions& options,
                               StageRuntime* runtime, MessageSink* upstream,
                               MessageSink* downstream, Inbox* inbox,
                               ProgressSink* progress)
    : job_(job),
      options_(options),
      runtime_(runtime),
      upstream_(upstream),
      downstream_(downstream),
      inbox_(inbox),
      progress_(progress) {}

absl::Status PipelineDriver::Run() {
  return options_.stage == 0 ? RunFirstStage() : RunLaterStage();
}

absl::StatusOr<InboundMessage> PipelineDriver::NextMessage() {
  std::optional<InboundMessage> in = inbox_->Pop();
  if (!in.has_value()) return absl::CancelledError("worker is stopping");
  if (!in->error.ok()) return in->error;
  return *std::move(in);
}

absl::Status PipelineDriver::SendDown(LinkMessage message) {
  if (downstream_ == nullptr) return absl::InternalError("no downstream link");
  message.header.set_epoch(options_.epoch);
  message.header.set_from_stage(options_.stage);
  return downstream_->Send(message);
}

absl::Status PipelineDriver::SendUp(LinkMessage message) {
  if (upstream_ == nullptr) return absl::InternalError("no upstream link");
  message.header.set_epoch(options_.epoch);
  message.header.set_from_stage(options_.stage);
  return upstream_->Send(message);
}

absl::Status PipelineDriver::FinishStep(int step) {
  RETURN_IF_ERROR(runtime_->ApplyUpdate());
  if (runtime_->is_last()) {
    const int64_t samples =
        static_cast<int64_t>(job_.microbatches()) * job_.microbatch_size();
    progress_->StepFinished(step, step_loss_sum_ / step_microbatches_, samples);
    step_loss_sum_ = 0;
    step_microbatches_ = 0;
  }
  step_backwards_ = 0;
  progress_->StageProgress(step);
  return absl::OkStatus();
}

absl::Status PipelineDriver::RunFirstStage() {
  const int microbatches = job_.microbatches();
  const int window = std::max(1, options_.num_stages);
  for (int step = options_.start_step; step < job_.steps(); ++step) {
    int issued = 0, finished = 0, in_flight = 0;
    while (finished < microbatches) {
      while (issued < microbatches && in_flight < window) {
        ASSIGN_OR_RETURN(LinkMessage input, runtime_->LoadTrainMicrobatch(step, issued++));
        if (runtime_->is_last()) {
          ASSIGN_OR_RETURN(LastStageResult result, runtime_->ForwardLoss(input));
          step_loss_sum_ += result.loss;
          ++step_microbatches_;
          ++finished;
          continue;
        }
        ASSIGN_OR_RETURN(LinkMessage activation, runtime_->Forward(input));
        RETURN_IF_ERROR(SendDown(std::move(activation)));
        ++in_flight;
      }
      if (finished == microbatches) break;
      ASSIGN_OR_RETURN(InboundMessage in, NextMessage());
      if (in.from_upstream) {
        return absl::InternalError("stage 0 received a message from upstream");
      }
      ASSIGN_OR_RETURN(std::optional<LinkMessage> up, runtime_->Backward(in.message));
      --in_flight;
      ++finished;
    }
    RETURN_IF_ERROR(FinishStep(step + 1));
    const bool last_step = step + 1 == job_.steps();
    if (last_step || (job_.eval_every() > 0 && (step + 1) % job_.eval_every() == 0)) {
      RETURN_IF_ERROR(RunEvaluation(step + 1));
    }
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
    if (runtime_->is_last()) {
      RETURN_IF_ERROR(runtime_->EvalForward(input));
    } else {
      ASSIGN_OR_RETURN(LinkMessage activation, runtime_->Forward(input));
      RETURN_IF_ERROR(SendDown(std::move(activation)));
    }
  }
  if (runtime_->is_last()) {
    progress_->EvalFinished(step, runtime_->TakeEvalResult());
    return absl::OkStatus();
  }
  LinkMessage end;
  end.header.set_kind(v1::MESSAGE_KIND_EVAL_END);
  end.header.set_step(step);
  return SendDown(std::move(end));
}

absl::Status PipelineDriver::RunLaterStage() {
  const int microbatches = job_.microbatches();
  while (true) {
    ASSIGN_OR_RETURN(InboundMessage in, NextMessage());
    const v1::LinkHeader& header = in.message.header;
    switch (header.kind()) {
      case v1::MESSAGE_KIND_ACTIVATION:
        if (runtime_->is_last()) {
          ASSIGN_OR_RETURN(LastStageResult result, runtime_->ForwardLoss(in.message));
          RETURN_IF_ERROR(SendUp(*std::move(result.gradient)));
          step_loss_sum_ += result.loss;
          if (++step_microbatches_ == microbatches) {
            RETURN_IF_ERROR(FinishStep(header.step() + 1));
          }
        } else {
          ASSIGN_OR_RETURN(LinkMessage activation, runtime_->Forward(in.message));
          RETURN_IF_ERROR(SendDown(std::move(activation)));
        }
        break;
      case v1::MESSAGE_KIND_GRADIENT: {
        ASSIGN_OR_RETURN(std::optional<LinkMessage> up, runtime_->Backward(in.message));
        RETURN_IF_ERROR(SendUp(*std::move(up)));
        if (++step_backwards_ == microbatches) {
          RETURN_IF_ERROR(FinishStep(header.step() + 1));
        }
        break;
      }
      case v1::MESSAGE_KIND_EVAL:
        if (runtime_->is_last()) {
          RETURN_IF_ERROR(runtime_->EvalForward(in.message));
        } else {
          ASSIGN_OR_RETURN(LinkMessage activation, runtime_->Forward(in.message));
          RETURN_IF_ERROR(SendDown(std::move(activation)));
        }
        break;
      case v1::MESSAGE_KIND_EVAL_END:
        if (runtime_->is_last()) {
          progress_->EvalFinished(header.step(), runtime_->TakeEvalResult());
        } else {
          RETURN_IF_ERROR(SendDown(in.message));
        }
        break;
      case v1::MESSAGE_KIND_DONE:
        if (!runtime_->is_last()) RETURN_IF_ERROR(SendDown(in.message));
        return absl::OkStatus();
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "unexpected message kind ", v1::MessageKind_Name(header.kind())));
    }
  }
}

}  // namespace geotrain
