// The stage's other workers, as the pipeline driver and a worker session
// see them: where this worker's weights go and what it takes from theirs.
// ReplicaAverager (gossip averaging over the ReplicaSync service) is the
// real one; a session test fakes it.
#ifndef GEOTRAIN_WORKER_STAGE_REPLICAS_H_
#define GEOTRAIN_WORKER_STAGE_REPLICAS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "geotrain/v1/stage.pb.h"

namespace geotrain {

struct ReplicaPeer {
  std::string worker_id;
  std::string address;  // where to dial (after any route)
};

// One plan's replicas of one stage.
struct ReplicaTarget {
  uint64_t epoch = 0;
  int stage = 0;
  int layer_begin = 0, layer_end = 0;
  std::string self_id;
  std::vector<ReplicaPeer> peers;  // the stage's other workers
  // The largest payload a pushed layer may declare (MaxLayerWeightsBytes of
  // the stage's largest layer).
  uint64_t max_layer_bytes = uint64_t{1} << 40;
};

// What a replica takes from its siblings' pushes: weights to average in,
// or to adopt (`adopt`: replace its own), or nothing.
struct ReceivedWeights {
  std::vector<v1::LayerWeights> layers;
  bool adopt = false;
};

// Thread-safe.
class StageReplicas {
 public:
  virtual ~StageReplicas() = default;
  // Serves and pushes for `target` until Deactivate() or the next Activate().
  virtual void Activate(ReplicaTarget target) = 0;
  // Refuses pushes again and forgets what was received and not yet taken.
  virtual void Deactivate() = 0;
  // Queues the stage's weights for every peer. Returns at once: a peer that
  // is absent or slow misses the round, it never holds this worker up.
  virtual void Push(int step, std::vector<v1::LayerWeights> layers, bool catching_up) = 0;
  // What arrived since the last call (see ReceivedWeights).
  virtual ReceivedWeights TakeReceived(bool catching_up) = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_STAGE_REPLICAS_H_
