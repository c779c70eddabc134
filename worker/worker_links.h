// The real SessionLinks: this worker's Stage service (LinkService) answers
// its neighbours' links, and OpenLink dials the ones the plan says it
// opens, with the worker's LinkOptions (credentials, deadlines, routes).
#ifndef GEOTRAIN_WORKER_WORKER_LINKS_H_
#define GEOTRAIN_WORKER_WORKER_LINKS_H_

#include <memory>
#include <set>
#include <string>

#include "worker/link_options.h"
#include "worker/link_service.h"
#include "worker/session_parts.h"

namespace geotrain {

class WorkerLinks final : public SessionLinks {
 public:
  // `service` outlives this object.
  WorkerLinks(LinkService* service, const LinkOptions* options)
      : service_(service), options_(options) {}

  void Activate(std::shared_ptr<const LinkValidator> validator, std::shared_ptr<Inbox> inbox,
                std::set<std::string> dialling_downstream) override {
    service_->Activate(std::move(validator), std::move(inbox), std::move(dialling_downstream));
  }
  void Deactivate() override { service_->Deactivate(); }
  absl::StatusOr<std::shared_ptr<PipelineLink>> Dial(const DialTarget& target,
                                                     std::shared_ptr<const LinkValidator> validator,
                                                     std::shared_ptr<Inbox> inbox,
                                                     const std::atomic<bool>* stop) override {
    absl::StatusOr<std::shared_ptr<LinkEnd>> end =
        OpenLink(target, std::move(validator), std::move(inbox), *options_, service_, stop);
    if (!end.ok()) return end.status();
    return std::shared_ptr<PipelineLink>(*std::move(end));
  }
  absl::StatusOr<std::shared_ptr<PipelineLink>> AwaitDialIn(
      PeerSide side, const std::string& peer_id, const std::atomic<bool>* stop) override {
    absl::StatusOr<std::shared_ptr<LinkEnd>> end =
        service_->AwaitDialIn(side, peer_id, options_->connect_timeout, stop);
    if (!end.ok()) return end.status();
    return std::shared_ptr<PipelineLink>(*std::move(end));
  }
  MessageSink* upstream() override { return service_->upstream_links(); }
  absl::Duration close_timeout() const override { return options_->close_timeout; }

 private:
  LinkService* const service_;
  const LinkOptions* const options_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_WORKER_LINKS_H_
