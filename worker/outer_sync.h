// The outer step's rounds among the replicas of one stage (the same stage in
// the plan's R pipelines), as a star whose centre, the reducer, is pipeline
// 0's worker (docs/pipelines.md, "The outer sync"):
//
//   - a replica ends its round t after the update of its step t * H (with
//     streaming, stage k of P at t * H + k * H / P, so the stages' syncs do
//     not share the uplink at once) and sends its pseudo-gradient (DELTA)
//     to the reducer; the reducer keeps its own;
//   - the reducer closes round t once every replica has contributed, or at
//     its deadline (blocking: `deadline` after its own contribution;
//     streaming: when its own round t + 1 ends), reduces what arrived in
//     pipeline order and sends the mean (MEAN, naming the contributors) to
//     every replica, applying the same bytes itself;
//   - every replica applies round t's mean once it has it: blocking, before
//     its next step (the driver waits, MustWait()); streaming, when it
//     arrives, keeping the inner steps taken since (one round late), and
//     always before it takes round t + 1's pseudo-gradient, which is
//     measured from round t's outer weights (a replica whose mean is that
//     late waits for it; the reducer closes round t at its own round
//     t + 1's end at the latest).
//
// The reducer alone decides a round's members, so every replica applies the
// same mean and ends each round on the same outer weights, whether or not
// its own contribution made it: a replica absent for a round contributes
// nothing to it. Contributions for a closed round are dropped; a mean that
// does not come is the caller's to time out (a lost link).
//
// Torch-free: the stage's outer optimizer is behind OuterCompute
// (StageRuntime's outer API), the links behind OuterTransport. Not
// thread-safe: the pipeline driver's thread calls everything.
#ifndef GEOTRAIN_WORKER_OUTER_SYNC_H_
#define GEOTRAIN_WORKER_OUTER_SYNC_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "geotrain/v1/stage.pb.h"

namespace geotrain {

struct OuterMessage {
  enum class Kind { kDelta, kMean, kState };
  Kind kind = Kind::kDelta;
  uint64_t epoch = 0;
  int stage = 0;
  int round = 0;                 // kState: the outer steps taken
  int pipeline = 0;              // the sender's
  int64_t samples = 0;           // DELTA: its samples; MEAN: all contributors'
  std::vector<int> contributors;  // MEAN: their pipelines, in order
  std::vector<v1::LayerWeights> layers;
};

// The stage's outer optimizer.
class OuterCompute {
 public:
  struct Contribution {
    int pipeline = 0;
    int64_t samples = 0;
    std::vector<v1::LayerWeights> layers;
  };
  virtual ~OuterCompute() = default;
  // This replica's encoded pseudo-gradient since the last outer step.
  virtual absl::StatusOr<std::vector<v1::LayerWeights>> ExportPseudoGradient() = 0;
  // The reducer: the samples-weighted mean of `contributions` (in pipeline
  // order), encoded for the wire.
  virtual absl::StatusOr<std::vector<v1::LayerWeights>> Reduce(
      const std::vector<Contribution>& contributions) = 0;
  // Every replica: the outer step on `mean` (as sent); with
  // `keep_local_progress` the inner steps since the export stay on top.
  virtual absl::Status ApplyMean(const std::vector<v1::LayerWeights>& mean,
                                 bool keep_local_progress) = 0;
  // The reducer's outer weights (and momentum, once it has taken a step),
  // lossless; and a replica taking them, with the inner steps it took
  // since its own outer weights kept on top.
  virtual absl::StatusOr<std::vector<v1::LayerWeights>> ExportState() = 0;
  virtual absl::Status AdoptState(const std::vector<v1::LayerWeights>& state,
                                  int64_t rounds) = 0;
  virtual int64_t rounds() const = 0;
};

// Sends to the replica of pipeline `to` (the reducer is pipeline 0).
class OuterTransport {
 public:
  virtual ~OuterTransport() = default;
  virtual absl::Status Send(int to, OuterMessage message) = 0;
  // The bytes of the messages sent so far (statistics).
  virtual uint64_t bytes_sent() const { return 0; }
};

struct OuterSyncOptions {
  uint64_t epoch = 0;
  int stage = 0;
  int stages = 1;
  int inner_steps = 50;  // H
  bool streaming = false;
  // The plan's start step: rounds that ended before it are behind every
  // replica of the stage (the next to end is the first this sync sees).
  int start_step = 0;
  // Blocking: how long the reducer waits for the others after its own
  // contribution, beyond what a pseudo-gradient takes to arrive at the
  // pace the replicas send at (transfer_time).
  absl::Duration deadline = absl::Seconds(10);
  // How long `bytes` take at the pace the outer transfers are held to
  // (the reducer's own pace stands for its replicas'; each sends over its
  // own uplink at once). Null, or zero: unpaced, nothing added.
  std::function<absl::Duration(uint64_t bytes)> transfer_time;
  // About what the reducer's outer state takes on the wire (an upper bound
  // will do; 0: unknown): what a replica that has not adopted it waits for.
  uint64_t state_bytes = 0;
  // The job's last step (0: none): a final round ends there, on schedule
  // or not, and is blocking in either mode, so every replica finishes on
  // the same outer weights.
  int final_step = 0;
  // At the start (Start()), the reducer sends its outer state to every
  // replica, and a replica adopts it before it ends a round: replicas that
  // drifted apart (a re-plan cut a round short, a standby took a place)
  // sync from the same outer weights again.
  bool share_state = false;
  // The epoch of the link with each other pipeline's replica (the later of
  // the two pipelines', OuterLinkEpochOf); missing: `epoch`. Every message
  // to or from that replica carries it.
  std::map<int, uint64_t> link_epochs;
};

class OuterSync {
 public:
  // `pipelines`: every pipeline with a replica of this stage in the plan,
  // this one's included; the reducer is pipeline 0's.
  OuterSync(OuterSyncOptions options, int self_pipeline, std::set<int> pipelines,
            OuterCompute* compute, OuterTransport* transport);

  bool reducer() const { return self_ == 0; }
  // The reducer: sends its outer state (share_state). Call once, first.
  absl::Status Start(absl::Time now);
  // The round that ends with the update of `step` (1-based), if one does.
  std::optional<int> RoundEndingAt(int step) const;
  // The newest round that ended at or before `step` (0: none).
  int RoundsEndedBy(int step) const;
  // After the update that ended `step`, having trained `samples` samples
  // since the last round ended: ends a round if one ends here.
  absl::Status AfterStep(int step, int64_t samples, absl::Time now);
  // A message from another replica of the stage. INVALID_ARGUMENT for one
  // that does not belong (another epoch or stage, a stranger's pipeline, a
  // DELTA to a non-reducer, a MEAN from one): the caller treats it as a
  // failing link.
  absl::Status OnMessage(const OuterMessage& message, absl::Time now);
  // The link to pipeline `pipeline`'s replica broke. The reducer goes on
  // without it (its rounds close on the others; it may come back only in a
  // new plan); a replica that lost the reducer trains on alone, ending no
  // more rounds, until the coordinator re-plans. Either way this pipeline
  // waits for nobody.
  absl::Status Detach(int pipeline, absl::Time now);
  bool detached() const { return detached_; }
  // A new plan in which this replica's pipeline continues (its session goes
  // on, pipeline_continuity.h) changed the stage's other replicas:
  //   - Leave: pipeline `pipeline`'s replica is gone or formed anew; its link
  //     ended on purpose. Nothing is reported. A replica whose reducer left
  //     trains on alone until one attaches.
  //   - Attach: pipeline `pipeline`'s replica (new, or formed anew) has its
  //     link, of epoch `link_epoch`: the reducer sends it the outer state (a
  //     replica then adopts it before its next round, whatever rounds it
  //     had); a replica that gets a new reducer waits for that state.
  absl::Status Leave(int pipeline, absl::Time now);
  absl::Status Attach(int pipeline, uint64_t link_epoch, absl::Time now);
  // Time passes (the driver calls it while it waits and between messages):
  // the reducer closes rounds past their deadline.
  absl::Status OnTime(absl::Time now);
  // The driver must wait before its next step: a round's mean is owed
  // (blocking mode, or the final round), or a round is due to end but the
  // mean of the one before has not come.
  bool MustWait() const;
  // The final round's mean is applied: nothing more will come.
  bool finished() const;
  // When the driver must call OnTime next (InfiniteFuture: nothing due).
  absl::Time NextDeadline() const;
  // How long, beyond a fixed timeout, a replica may wait for what it owes
  // a wait to (MustWait()) before it takes the reducer as lost: its
  // pseudo-gradient's time at the pace up, the reducer's deadline for the
  // others, and the mean's time at the pace down, once for each replica the
  // reducer sends it to over its one uplink (the outer state's instead of
  // the mean's while that is not adopted yet). Unpaced: the deadline alone.
  absl::Duration WaitAllowance() const;

  int rounds_applied() const { return applied_; }
  const OuterTransport& transport() const { return *transport_; }
  // Per closed round (the reducer) or applied round: its contributors.
  const std::map<int, std::vector<int>>& members() const { return members_; }

 private:
  struct Round {
    std::map<int, OuterCompute::Contribution> contributions;  // by pipeline
    absl::Time deadline = absl::InfiniteFuture();
  };
  // Takes and sends (or keeps, the reducer) the due round's
  // pseudo-gradient once the round before is applied; applies the means
  // that can be.
  absl::Status Advance(absl::Time now);
  // The reducer: closes the rounds past their deadline.
  absl::Status CloseDue(absl::Time now);
  absl::Status Close(int round);
  // This replica's message of `kind` for `round` to pipeline `to` (no
  // layers yet).
  OuterMessage MessageOf(OuterMessage::Kind kind, int to, int round, int64_t samples) const;
  uint64_t EpochFor(int pipeline) const;
  // The reducer: its outer state to pipeline `to`.
  absl::Status SendState(int to);
  absl::Status Apply(int round, const std::vector<v1::LayerWeights>& mean,
                     std::vector<int> contributors);
  absl::Status ApplyPending();
  // RoundsEndedBy without the final round.
  int ScheduledRoundsEndedBy(int step) const;
  int final_round() const;
  // How long `bytes` take at the outer pace (zero unpaced).
  absl::Duration TransferTime(uint64_t bytes) const;

  OuterSyncOptions options_;
  const int self_;
  std::set<int> pipelines_;
  bool detached_ = false;  // a replica that lost the reducer
  bool state_pending_ = false;  // a replica that has not adopted the reducer's state
  std::set<int> dropped_;  // the reducer: pipelines detached
  OuterCompute* const compute_;
  OuterTransport* const transport_;
  int due_ = 0;      // the newest round whose end step passed
  int64_t due_samples_ = 0;  // the samples trained in it
  int ended_ = 0;    // the newest round this replica ended (sent its pseudo-gradient)
  int applied_ = 0;  // the newest round whose mean it applied
  int closed_ = 0;   // the reducer: the newest round it closed
  uint64_t last_sent_bytes_ = 0;  // this replica's last pseudo-gradient
  std::map<int, Round> open_;  // the reducer's rounds not yet closed
  // Means that came before this replica ended their round (a replica may
  // trail the reducer), applied in order once it has.
  std::map<int, OuterMessage> pending_means_;
  std::map<int, std::vector<int>> members_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_WORKER_OUTER_SYNC_H_
