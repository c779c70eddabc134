// Keeps the two copies of a tied embedding equal (llama.tie_embeddings).
// The first stage holds the token embedding, the last the head; the head's
// matrix is the embedding's, so each stage trains a copy. At every update
// the two ends send each other their gradient sum of that matrix (the
// Megatron way: an exchange between the first and the last stage), and both
// apply embedding + head, the same float32 sum on each side, so the copies
// stay bit-equal when the two run the same optimizer on the same device
// kind.
//
// The exchange blocks the update until the peer's sum has arrived, so it is
// used only under the sync schedule: its flushed step leaves nothing in
// flight between the two ends at an update, so neither can wait on the
// other's pipeline work.
//
// The server half (TiedEmbedding service) accepts one push per update from
// the plan's other end only (its certificate's identity with TLS), of
// exactly the matrix's size, in ~1 MiB parts that continue where the last
// ended. Torch-free; thread-safe.
#ifndef GEOTRAIN_WORKER_TIED_GRADIENT_EXCHANGE_H_
#define GEOTRAIN_WORKER_TIED_GRADIENT_EXCHANGE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transport_security.h"
#include "geotrain/v1/stage.grpc.pb.h"

namespace geotrain {

class TiedGradientExchange final : public v1::TiedEmbedding::Service {
 public:
  struct Target {
    uint64_t epoch = 0;
    int stage = 0;  // this end's
    std::string self_id;
    int peer_stage = 0;  // the other end's
    std::string peer_id;
    std::string peer_address;  // where to dial (after any route)
    uint64_t gradient_bytes = 0;  // float32 [vocab, d_model]: what each end sends
  };

  // A push may take `push_deadline` plus its size at
  // `min_push_bytes_per_second`; the peer's sum may take `wait_limit` to
  // come (the other end finishes its step's backwards later).
  explicit TiedGradientExchange(absl::Duration push_deadline = absl::Seconds(5),
                                double min_push_bytes_per_second = 1 << 20,
                                absl::Duration wait_limit = absl::Minutes(5));

  // REQUIRES: called before serving or the first Activate().
  void UseSecurity(const TransportSecurity& security) { security_ = security; }

  // Serves and exchanges for `target` until Deactivate() or the next
  // Activate(); either ends an Exchange() that is waiting.
  void Activate(Target target);
  void Deactivate();

  // Sends this end's gradient sum at `update` (exactly gradient_bytes) and
  // returns the peer's for the same update. UNAVAILABLE (naming the peer)
  // when the push fails or the peer's sum does not come within the wait
  // limit; ABORTED when the plan changed meanwhile.
  absl::StatusOr<std::string> Exchange(int64_t update, std::string_view mine);

  grpc::Status PushGradient(grpc::ServerContext* context,
                            grpc::ServerReader<v1::TiedGradientPart>* reader,
                            v1::PushTiedGradientResponse* response) override;

 private:
  grpc::Status Send(const Target& target, int64_t update, std::string_view mine);

  const absl::Duration push_deadline_;
  const double min_push_bytes_per_second_;
  const absl::Duration wait_limit_;
  TransportSecurity security_;
  mutable absl::Mutex mu_;
  std::optional<Target> target_ ABSL_GUARDED_BY(mu_);
  uint64_t activations_ ABSL_GUARDED_BY(mu_) = 0;  // tells a waiter the plan changed
  // Whole pushes of the peer not yet taken, by update: at most two (the
  // peer may be one update ahead of this end).
  std::map<int64_t, std::string> received_ ABSL_GUARDED_BY(mu_);
  int64_t last_taken_ ABSL_GUARDED_BY(mu_) = -1;
  std::unique_ptr<v1::TiedEmbedding::Stub> stub_;  // Exchange's caller only
  std::string stub_address_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_TIED_GRADIENT_EXCHANGE_H_
