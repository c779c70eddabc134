// Keeps the replicas of one stage close: every job.replica_sync_every steps
// each replica pushes its current weights (encoded with job.replica_codec)
// to the others, and each averages what it received into its own weights at
// its next update (StageRuntime::AverageWeights). This is gossip averaging:
// pushes are one-way, each with a deadline, sent from a background thread,
// so a paused or dead replica never holds up the others; it only misses a
// round.
//
// A replica that joined a running stage restored it from a checkpoint, up
// to checkpoint_every steps old. Until it has taken a sibling's weights it
// is "catching up": its pushes say so, and a sibling that is not catching
// up ignores them (averaging them in would pull it back), while the
// newcomer adopts the first weights it receives from a sibling that is not
// catching up, instead of averaging. Two newcomers average each other.
//
// A push is one stream of ~1 MiB messages (a large layer cut into parts),
// with a deadline that grows with its size, so a layer of any size goes
// through. The server half (ReplicaSync service) accepts pushes for the
// active plan epoch and stage from the stage's other workers, checks each
// part's place as it arrives (a layer's declared size is bounded by
// Target::max_layer_bytes before anything is kept), and keeps the newest
// complete push of each peer until the driver takes it. Torch-free;
// thread-safe.
#ifndef GEOTRAIN_WORKER_REPLICA_AVERAGER_H_
#define GEOTRAIN_WORKER_REPLICA_AVERAGER_H_

#include <cstdint>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/transport_security.h"
#include "absl/time/time.h"
#include "worker/stage_replicas.h"
#include "geotrain/v1/stage.grpc.pb.h"

namespace geotrain {

class ReplicaAverager final : public v1::ReplicaSync::Service, public StageReplicas {
 public:
  using Peer = ReplicaPeer;
  using Target = ReplicaTarget;
  using Received = ReceivedWeights;

  // Each push may take `push_deadline` plus its size at
  // `min_push_bytes_per_second`; one that takes longer fails (that round).
  explicit ReplicaAverager(absl::Duration push_deadline = absl::Seconds(5),
                           double min_push_bytes_per_second = 1 << 20);
  ~ReplicaAverager() override;

  // mTLS between replicas: a push must come from the worker its
  // certificate names, and goes only to a peer whose certificate names it.
  // REQUIRES: called before serving or the first Activate().
  void UseSecurity(const TransportSecurity& security) { security_ = security; }

  // Serves and pushes for `target` until Deactivate() or the next Activate().
  void Activate(Target target) override;
  // Refuses pushes again and forgets what was received and not yet taken.
  void Deactivate() override;

  // Queues the stage's weights for every peer; a push still queued (a peer
  // was slow) is replaced by this newer one. Returns at once.
  void Push(int step, std::vector<v1::LayerWeights> layers, bool catching_up = false) override;
  // The whole pushes received since the last call, the newest of each peer,
  // as this replica should use them (see above).
  Received TakeReceived(bool catching_up = false) override;

  struct Counters {
    int64_t pushes_sent = 0;      // whole pushes delivered to a peer
    int64_t pushes_failed = 0;    // deadline passed, peer gone, refused
    int64_t pushes_received = 0;  // whole pushes accepted from peers
  };
  Counters counters() const;

  grpc::Status PushWeights(grpc::ServerContext* context,
                           grpc::ServerReader<v1::ReplicaWeights>* reader,
                           v1::PushWeightsResponse* response) override;

 private:
  struct PeerPush {
    int step = -1;
    bool catching_up = false;
    std::map<int, v1::LayerWeights> layers;
  };
  // Checks one message of a push against the target and the parts before
  // it, and appends its parts to `push`.
  static grpc::Status AddParts(const Target& target, const v1::ReplicaWeights& message,
                               const v1::ReplicaWeights& first, PeerPush& push,
                               std::map<int, uint64_t>& declared);
  void SendLoop();
  bool SendPush(v1::ReplicaSync::Stub& stub, int step, bool catching_up, const Target& target,
                const std::vector<v1::LayerWeights>& layers, std::string* error);

  const absl::Duration push_deadline_;
  const double min_push_bytes_per_second_;
  TransportSecurity security_;
  mutable absl::Mutex mu_;
  // Pushes being received, by sender: one at a time per sibling (a push
  // holds a stage's weights in memory while it arrives).
  std::set<std::string> receiving_ ABSL_GUARDED_BY(mu_);
  std::optional<Target> target_ ABSL_GUARDED_BY(mu_);
  // The newest complete push of each peer, not yet taken.
  std::map<std::string, PeerPush> received_ ABSL_GUARDED_BY(mu_);
  // The next push (whole layers; cut into messages as they are sent).
  struct PendingPush {
    int step = 0;
    bool catching_up = false;
    Target target;
    std::vector<v1::LayerWeights> layers;
  };
  std::optional<PendingPush> pending_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<v1::ReplicaSync::Stub>> stubs_;  // SendLoop only
  Counters counters_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sender_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_REPLICA_AVERAGER_H_
