// The holder's end of a peer state transfer (StageState.FetchLayerState):
// a worker that keeps its stage into a new plan epoch whose newcomers the
// plan sends to it (StageAssignment.state_source) offers a snapshot of its
// stage taken as the epoch began, and serves it in LayerStateChunks to
// exactly those newcomers, each once; the snapshot is dropped when every
// one has it or the next offer replaces it. A fetch that arrives before
// the offer waits for it (up to `wait_for_offer`). Thread-safe; gRPC's
// threads call FetchLayerState.
#ifndef GEOTRAIN_WORKER_STAGE_STATE_SERVER_H_
#define GEOTRAIN_WORKER_STAGE_STATE_SERVER_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transport_security.h"
#include "geotrain/v1/stage.grpc.pb.h"

namespace geotrain {

class StageStateServer final : public v1::StageState::Service {
 public:
  explicit StageStateServer(absl::Duration wait_for_offer = absl::Seconds(30))
      : wait_for_offer_(wait_for_offer) {}

  // TLS: a caller is the worker its certificate names; insecure (the
  // default until this is called): whoever the request names.
  void UseSecurity(const TransportSecurity& security);

  // Offers `layers` ([layer_begin, layer_end) of the stage) of plan `epoch`
  // to `for_workers`; replaces any earlier offer.
  void Offer(uint64_t epoch, int layer_begin, int layer_end, std::vector<std::string> for_workers,
             std::vector<v1::LayerCheckpoint> layers);
  void Withdraw();

  struct Counters {
    int64_t layers_served = 0;
    int64_t bytes_served = 0;
  };
  Counters counters() const;

  grpc::Status FetchLayerState(grpc::ServerContext* context,
                               const v1::FetchLayerStateRequest* request,
                               grpc::ServerWriter<v1::LayerStateChunk>* writer) override;

 private:
  struct Offered {
    uint64_t epoch = 0;
    int layer_begin = 0, layer_end = 0;
    std::set<std::string> waiting;
    std::shared_ptr<const std::vector<v1::LayerCheckpoint>> layers;
  };
  const absl::Duration wait_for_offer_;
  mutable absl::Mutex mu_;
  // Fetches waiting for an offer: each holds a thread for up to
  // wait_for_offer_, so one caller may hold kMaxWaitsPerCaller of them and
  // all together kMaxWaits (issue 32: 400 fetches for a future epoch held
  // 399 threads).
  static constexpr int kMaxWaitsPerCaller = 2;
  static constexpr int kMaxWaits = 16;
  std::map<std::string, int> waits_ ABSL_GUARDED_BY(mu_);
  int waits_total_ ABSL_GUARDED_BY(mu_) = 0;
  bool insecure_ ABSL_GUARDED_BY(mu_) = true;
  std::unique_ptr<Offered> offer_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

// The newcomer's end: fetches [layer_begin, layer_end) of plan `epoch`'s
// stage from the holder at `address` (TLS: it must be `holder_id`). Each
// layer is checked as it arrives and refused past `max_layer_bytes`.
absl::StatusOr<std::vector<v1::LayerCheckpoint>> FetchStageState(
    const std::string& address, const std::string& holder_id, const TransportSecurity& security,
    const v1::FetchLayerStateRequest& request, uint64_t max_layer_bytes, absl::Duration deadline);

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_STAGE_STATE_SERVER_H_
