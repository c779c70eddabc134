#include "coordinator/plan_streams.h"

#include <optional>
#include <utility>
#include <vector>

namespace geotrain {

// One WatchPlan call. It owns itself (self_) until gRPC says the call is
// done (OnDone); the registry and a publication in progress hold weak or
// short-lived shared references. Finish and StartWrite are called with no
// lock held, and nothing touches the object after Finish.
class PlanStreams::Stream : public grpc::ServerWriteReactor<v1::Plan>,
                            public std::enable_shared_from_this<Stream> {
 public:
  Stream(PlanStreams* owner, std::string worker, std::function<void()> release)
      : owner_(owner), worker_(std::move(worker)), release_(std::move(release)) {}

  void Start(std::shared_ptr<Stream> self) { self_ = std::move(self); }

  // A plan to send: newer than anything offered before, it replaces one
  // still waiting.
  void Offer(const PlanPublisher::PlanPtr& plan) {
    absl::MutexLock lock(&mu_);
    if (ended_ || plan == nullptr || plan->epoch() <= offered_epoch_) return;
    offered_epoch_ = plan->epoch();
    pending_ = plan;
    WriteNextLocked();
  }

  void Stop(const grpc::Status& status) {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      finish = EndLocked(status);
    }
    if (finish.has_value()) Finish(*finish);
  }

  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        finish = EndLocked(grpc::Status::CANCELLED);
      } else if (deferred_.has_value()) {
        finish = deferred_;
        deferred_.reset();
      } else if (sent_job_done_) {
        finish = EndLocked(grpc::Status::OK);
      } else {
        WriteNextLocked();
      }
    }
    if (finish.has_value()) Finish(*finish);
  }

  void OnCancel() override { Stop(grpc::Status::CANCELLED); }

  void OnDone() override {
    owner_->Remove(this);
    if (release_) release_();
    self_.reset();  // the last reference, unless a publication holds one
  }

 private:
  // The status to finish with now (the caller calls Finish unlocked), or
  // nullopt: already ended, or a write is in flight (then OnWriteDone
  // finishes).
  std::optional<grpc::Status> EndLocked(const grpc::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_) return std::nullopt;
    ended_ = true;
    pending_ = nullptr;
    if (writing_) {
      deferred_ = status;
      return std::nullopt;
    }
    return status;
  }

  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || pending_ == nullptr || ended_) return;
    view_ = owner_->view_(*pending_, worker_);
    sent_job_done_ = pending_->job_done();
    pending_ = nullptr;
    writing_ = true;
    // The write completes on a gRPC thread (OnWriteDone); view_ stays put
    // until then, as writing_ keeps it.
    StartWrite(&view_);
  }

  PlanStreams* const owner_;
  const std::string worker_;
  const std::function<void()> release_;
  std::shared_ptr<Stream> self_;
  absl::Mutex mu_;
  PlanPublisher::PlanPtr pending_ ABSL_GUARDED_BY(mu_);
  uint64_t offered_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  v1::Plan view_;  // the message in flight (see WriteNextLocked)
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool sent_job_done_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> deferred_ ABSL_GUARDED_BY(mu_);
};

PlanStreams::~PlanStreams() { Shutdown(); }

grpc::ServerWriteReactor<v1::Plan>* PlanStreams::Open(const std::string& worker,
                                                      PlanPublisher::PlanPtr current,
                                                      std::function<void()> release) {
  auto stream = std::make_shared<Stream>(this, worker, std::move(release));
  stream->Start(stream);
  bool shutdown;
  {
    absl::MutexLock lock(&mu_);
    shutdown = shutdown_;
    if (!shutdown) streams_[stream.get()] = stream;
    // A plan published while this one was looked up is not missed.
    if (newest_ != nullptr && (current == nullptr || newest_->epoch() > current->epoch())) {
      current = newest_;
    }
  }
  if (shutdown) {
    stream->Stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
  } else {
    stream->Offer(current);
  }
  return stream.get();
}

void PlanStreams::Publish(const PlanPublisher::PlanPtr& plan) {
  std::vector<std::shared_ptr<Stream>> open;
  {
    absl::MutexLock lock(&mu_);
    newest_ = plan;
    open.reserve(streams_.size());
    for (const auto& [raw, weak] : streams_) {
      if (std::shared_ptr<Stream> stream = weak.lock()) open.push_back(std::move(stream));
    }
  }
  for (const std::shared_ptr<Stream>& stream : open) stream->Offer(plan);
}

void PlanStreams::Shutdown() {
  std::vector<std::shared_ptr<Stream>> open;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    shutdown_ = true;
    for (const auto& [raw, weak] : streams_) {
      if (std::shared_ptr<Stream> stream = weak.lock()) open.push_back(std::move(stream));
    }
  }
  for (const std::shared_ptr<Stream>& stream : open) {
    stream->Stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
  }
}

int PlanStreams::open() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(streams_.size());
}

void PlanStreams::Remove(Stream* stream) {
  absl::MutexLock lock(&mu_);
  streams_.erase(stream);
}

}  // namespace geotrain
