#include "coordinator/plan_streams.h"

#include <optional>
#include <utility>

namespace geotrain {

struct PlanStreams::Tag {
  enum class Op { kRequest, kWrite, kFinish, kDone };
  Stream* stream;
  Op op;
};

// One WatchPlan call. Its completions arrive on the queue's thread; Offer
// comes from the publisher's thread. Its mutex guards the state; at most
// one write is in flight, and Finish waits for it.
class PlanStreams::Stream {
 public:
  explicit Stream(PlanStreams* owner) : owner_(owner), writer_(&context_) {}

  grpc::ServerContext* context() { return &context_; }
  v1::WatchPlanRequest* request() { return &request_; }
  grpc::ServerAsyncWriter<v1::Plan>* writer() { return &writer_; }
  Tag* tag(Tag::Op op) {
    switch (op) {
      case Tag::Op::kRequest: return &request_tag_;
      case Tag::Op::kWrite: return &write_tag_;
      case Tag::Op::kFinish: return &finish_tag_;
      case Tag::Op::kDone: return &done_tag_;
    }
    return nullptr;
  }

  const std::string& worker() const { return worker_; }
  void set_worker(std::string worker) { worker_ = std::move(worker); }
  bool admitted() const { return admitted_; }
  void set_admitted() { admitted_ = true; }

  void Offer(const PlanPublisher::PlanPtr& plan) {
    absl::MutexLock lock(&mu_);
    if (ended_ || plan == nullptr || plan->epoch() <= offered_epoch_) return;
    offered_epoch_ = plan->epoch();
    pending_ = plan;
    WriteNextLocked();
  }

  void End(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    EndLocked(status);
  }

  // A write completed. True when the stream may be freed.
  bool WriteDone(bool ok) {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      EndLocked(grpc::Status::CANCELLED);
    } else if (deferred_.has_value()) {
      FinishLocked(*deferred_);
    } else if (sent_job_done_) {
      EndLocked(grpc::Status::OK);
    } else {
      WriteNextLocked();
    }
    return FreeableLocked();
  }

  bool FinishDone() {
    absl::MutexLock lock(&mu_);
    finish_done_ = true;
    return FreeableLocked();
  }

  bool CallDone() {
    absl::MutexLock lock(&mu_);
    call_done_ = true;
    // The caller went (or the call ended): nothing more is sent.
    EndLocked(grpc::Status::CANCELLED);
    return FreeableLocked();
  }

 private:
  void EndLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_) return;
    ended_ = true;
    pending_ = nullptr;
    if (writing_) {
      deferred_ = status;  // finished once the write completes
    } else {
      FinishLocked(status);
    }
  }

  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    deferred_.reset();
    finishing_ = true;
    writer_.Finish(status, &finish_tag_);
  }

  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || pending_ == nullptr || ended_) return;
    view_ = owner_->view_(*pending_, worker_);
    sent_job_done_ = pending_->job_done();
    pending_ = nullptr;
    writing_ = true;
    writer_.Write(view_, &write_tag_);
  }

  // Every operation started has completed: the call is over, its finish
  // is done and no write is in flight.
  bool FreeableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return call_done_ && (finish_done_ || !finishing_) && !writing_;
  }

  PlanStreams* const owner_;
  grpc::ServerContext context_;
  v1::WatchPlanRequest request_;
  grpc::ServerAsyncWriter<v1::Plan> writer_;
  Tag request_tag_{this, Tag::Op::kRequest};
  Tag write_tag_{this, Tag::Op::kWrite};
  Tag finish_tag_{this, Tag::Op::kFinish};
  Tag done_tag_{this, Tag::Op::kDone};
  std::string worker_;     // set on the queue's thread before any Offer
  bool admitted_ = false;  // the queue's thread only
  absl::Mutex mu_;
  PlanPublisher::PlanPtr pending_ ABSL_GUARDED_BY(mu_);
  uint64_t offered_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  v1::Plan view_;  // the message in flight (writing_ keeps it)
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool sent_job_done_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_done_ ABSL_GUARDED_BY(mu_) = false;
  bool call_done_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> deferred_ ABSL_GUARDED_BY(mu_);
};

PlanStreams::PlanStreams(ViewFn view, AdmitFn admit, ReleaseFn release,
                         std::function<PlanPublisher::PlanPtr()> visible)
    : view_(std::move(view)),
      admit_(std::move(admit)),
      release_(std::move(release)),
      visible_(std::move(visible)) {}

PlanStreams::~PlanStreams() { Stop(); }

void PlanStreams::Attach(grpc::ServerBuilder* builder) { queue_ = builder->AddCompletionQueue(); }

void PlanStreams::Start(RequestFn request) {
  request_ = std::move(request);
  Accept();
  thread_ = std::thread([this] {
    void* tag = nullptr;
    bool ok = false;
    while (queue_->Next(&tag, &ok)) Handle(static_cast<Tag*>(tag), ok);
  });
}

void PlanStreams::Accept() {
  auto* stream = new Stream(this);
  stream->context()->AsyncNotifyWhenDone(stream->tag(Tag::Op::kDone));
  request_(stream->context(), stream->request(), stream->writer(), queue_.get(),
           stream->tag(Tag::Op::kRequest));
}

void PlanStreams::Handle(Tag* tag, bool ok) {
  Stream* stream = tag->stream;
  bool freeable = false;
  switch (tag->op) {
    case Tag::Op::kRequest: {
      if (!ok) {  // the server is shutting down; this call never started
        unstarted_.push_back(stream);
        return;
      }
      Accept();  // the next call
      std::string worker;
      grpc::Status admitted = admit_(*stream->context(), *stream->request(), &worker);
      bool shutdown;
      {
        absl::MutexLock lock(&mu_);
        shutdown = shutdown_;
        if (admitted.ok() && !shutdown) open_.insert(stream);
      }
      if (!admitted.ok()) {
        stream->End(admitted);
        return;
      }
      stream->set_worker(std::move(worker));
      stream->set_admitted();
      if (shutdown) {
        stream->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
        return;
      }
      stream->Offer(visible_());
      return;
    }
    case Tag::Op::kWrite:
      freeable = stream->WriteDone(ok);
      break;
    case Tag::Op::kFinish:
      freeable = stream->FinishDone();
      break;
    case Tag::Op::kDone:
      freeable = stream->CallDone();
      break;
  }
  if (freeable) Forget(stream);
}

void PlanStreams::Forget(Stream* stream) {
  {
    // Off the registry first: no publication reaches it after this.
    absl::MutexLock lock(&mu_);
    open_.erase(stream);
  }
  if (stream->admitted()) release_(stream->worker());
  delete stream;
}

void PlanStreams::Publish(const PlanPublisher::PlanPtr& plan) {
  absl::MutexLock lock(&mu_);
  for (Stream* stream : open_) stream->Offer(plan);
}

void PlanStreams::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return;
  shutdown_ = true;
  for (Stream* stream : open_) {
    stream->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
  }
}

void PlanStreams::Stop() {
  if (stopped_ || queue_ == nullptr) return;
  stopped_ = true;
  Shutdown();
  queue_->Shutdown();
  if (thread_.joinable()) thread_.join();
  // The queue is drained: nothing can reach these any more.
  for (Stream* stream : unstarted_) delete stream;
  unstarted_.clear();
  absl::MutexLock lock(&mu_);
  for (Stream* stream : open_) delete stream;
  open_.clear();
}

int PlanStreams::open() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(open_.size());
}

}  // namespace geotrain
