// The outer sync's rounds among a stage's replicas, with a fake outer
// optimizer (payloads are strings naming what they hold) and a fake
// transport the test delivers by hand: every replica applies the same mean
// whether or not its own contribution made it, a replica absent for a round
// contributes nothing, streaming closes a round a round late and keeps the
// local progress, and messages that do not belong are refused.
#include "worker/outer_sync.h"

#include <gtest/gtest.h>

#include <deque>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace geotrain {
namespace {

std::vector<v1::LayerWeights> Payload(const std::string& text) {
  std::vector<v1::LayerWeights> layers(1);
  layers[0].set_payload(text);
  return layers;
}

class FakeCompute : public OuterCompute {
 public:
  explicit FakeCompute(int pipeline) : pipeline_(pipeline) {}
  absl::StatusOr<std::vector<v1::LayerWeights>> ExportPseudoGradient() override {
    return Payload(absl::StrCat("d", pipeline_, ".", ++exports_));
  }
  absl::StatusOr<std::vector<v1::LayerWeights>> Reduce(
      const std::vector<Contribution>& contributions) override {
    std::vector<std::string> parts;
    for (const Contribution& c : contributions) {
      parts.push_back(absl::StrCat(c.layers[0].payload(), "x", c.samples));
    }
    return Payload("mean(" + absl::StrJoin(parts, ",") + ")");
  }
  absl::Status ApplyMean(const std::vector<v1::LayerWeights>& mean,
                         bool keep_local_progress) override {
    applied.push_back(mean[0].payload());
    kept_progress.push_back(keep_local_progress);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<v1::LayerWeights>> ExportState() override {
    return Payload(absl::StrCat("state", pipeline_));
  }
  absl::Status AdoptState(const std::vector<v1::LayerWeights>& state, int64_t rounds) override {
    adopted.push_back(absl::StrCat(state[0].payload(), "@", rounds));
    return absl::OkStatus();
  }
  int64_t rounds() const override { return static_cast<int64_t>(applied.size()); }
  std::vector<std::string> applied;
  std::vector<bool> kept_progress;
  std::vector<std::string> adopted;

 private:
  const int pipeline_;
  int exports_ = 0;
};

struct Sent {
  int from, to;
  OuterMessage message;
};

class Wire : public OuterTransport {
 public:
  Wire(std::deque<Sent>* queue, int from) : queue_(queue), from_(from) {}
  absl::Status Send(int to, OuterMessage message) override {
    queue_->push_back({from_, to, std::move(message)});
    return absl::OkStatus();
  }

 private:
  std::deque<Sent>* queue_;
  int from_;
};

OuterSyncOptions Options(uint64_t epoch, int stage, int stages, int inner_steps,
                         bool streaming = false, int start_step = 0,
                         absl::Duration deadline = absl::Seconds(10)) {
  OuterSyncOptions options;
  options.epoch = epoch;
  options.stage = stage;
  options.stages = stages;
  options.inner_steps = inner_steps;
  options.streaming = streaming;
  options.start_step = start_step;
  options.deadline = deadline;
  return options;
}

class OuterSyncTest : public testing::Test {
 protected:
  void Make(int replicas, OuterSyncOptions options) {
    std::set<int> pipelines;
    for (int p = 0; p < replicas; ++p) pipelines.insert(p);
    for (int p = 0; p < replicas; ++p) {
      computes_.push_back(std::make_unique<FakeCompute>(p));
      wires_.push_back(std::make_unique<Wire>(&queue_, p));
      syncs_.push_back(std::make_unique<OuterSync>(options, p, pipelines, computes_[p].get(),
                                                   wires_[p].get()));
    }
  }
  // Delivers what is on the wire, except to and from `cut`.
  void Deliver(int cut = -1) {
    while (!queue_.empty()) {
      Sent sent = std::move(queue_.front());
      queue_.pop_front();
      if (sent.to == cut || sent.from == cut) continue;
      ASSERT_TRUE(syncs_[sent.to]->OnMessage(sent.message, now_).ok());
    }
  }
  absl::Time now_ = absl::FromUnixSeconds(1000);
  std::deque<Sent> queue_;
  std::vector<std::unique_ptr<FakeCompute>> computes_;
  std::vector<std::unique_ptr<Wire>> wires_;
  std::vector<std::unique_ptr<OuterSync>> syncs_;
};

TEST_F(OuterSyncTest, EveryReplicaAppliesTheSameMeanOfAll) {
  Make(3, Options(4, 1, 2, 5));
  for (int step = 1; step <= 4; ++step) {
    for (auto& s : syncs_) ASSERT_TRUE(s->AfterStep(step, 10, now_).ok());
  }
  EXPECT_TRUE(queue_.empty());  // no round ends before step 5
  for (int p = 0; p < 3; ++p) ASSERT_TRUE(syncs_[p]->AfterStep(5, 10 + p, now_).ok());
  EXPECT_TRUE(syncs_[1]->MustWait());  // blocking: the mean is owed
  Deliver();
  for (int p = 0; p < 3; ++p) {
    ASSERT_EQ(computes_[p]->applied.size(), 1u) << p;
    EXPECT_EQ(computes_[p]->applied[0], "mean(d0.1x10,d1.1x11,d2.1x12)") << p;
    EXPECT_FALSE(computes_[p]->kept_progress[0]);
    EXPECT_FALSE(syncs_[p]->MustWait());
    EXPECT_EQ(syncs_[p]->rounds_applied(), 1);
    EXPECT_EQ(syncs_[p]->members().at(1), std::vector<int>({0, 1, 2}));
  }
}

TEST_F(OuterSyncTest, AnAbsentReplicaContributesNothingButTakesTheSameMean) {
  Make(3, Options(4, 0, 2, 2, false, 0, absl::Seconds(10)));
  for (int step = 1; step <= 2; ++step) {
    for (int p : {0, 1}) ASSERT_TRUE(syncs_[p]->AfterStep(step, 8, now_).ok());
  }
  Deliver();
  EXPECT_TRUE(computes_[0]->applied.empty());  // the reducer waits for pipeline 2
  EXPECT_EQ(syncs_[0]->NextDeadline(), now_ + absl::Seconds(10));
  now_ += absl::Seconds(11);
  ASSERT_TRUE(syncs_[0]->OnTime(now_).ok());
  // Pipeline 2 ends its round late: its contribution is dropped, and it
  // applies the same mean as the others.
  for (int step = 1; step <= 2; ++step) ASSERT_TRUE(syncs_[2]->AfterStep(step, 8, now_).ok());
  Deliver();
  for (int p = 0; p < 3; ++p) {
    ASSERT_EQ(computes_[p]->applied.size(), 1u) << p;
    EXPECT_EQ(computes_[p]->applied[0], "mean(d0.1x8,d1.1x8)") << p;
  }
  EXPECT_EQ(syncs_[0]->members().at(1), std::vector<int>({0, 1}));
}

// Blocking, the reducer waits a pseudo-gradient's transfer at the outer
// pace on top of its deadline: a large stage's replicas on a thin uplink
// still make the round, where two leases alone would close it without them.
TEST_F(OuterSyncTest, TheReducerAlsoWaitsWhatAPseudoGradientTakesAtThePace) {
  OuterSyncOptions options = Options(4, 0, 2, 2, false, 0, absl::Seconds(10));
  options.transfer_time = [](uint64_t bytes) { return absl::Seconds(bytes); };  // 1 B/s
  Make(2, options);
  for (int step = 1; step <= 2; ++step) ASSERT_TRUE(syncs_[0]->AfterStep(step, 8, now_).ok());
  const int64_t bytes = static_cast<int64_t>(Payload("d0.1")[0].ByteSizeLong());
  ASSERT_GT(bytes, 0);
  EXPECT_EQ(syncs_[0]->NextDeadline(), now_ + absl::Seconds(10) + absl::Seconds(bytes));
  // Past the two leases, within the transfer: the round is still open.
  now_ += absl::Seconds(10) + absl::Seconds(bytes) - absl::Seconds(1);
  ASSERT_TRUE(syncs_[0]->OnTime(now_).ok());
  EXPECT_TRUE(computes_[0]->applied.empty());
  for (int step = 1; step <= 2; ++step) ASSERT_TRUE(syncs_[1]->AfterStep(step, 8, now_).ok());
  Deliver();
  for (int p = 0; p < 2; ++p) {
    ASSERT_EQ(computes_[p]->applied.size(), 1u) << p;
    EXPECT_EQ(computes_[p]->applied[0], "mean(d0.1x8,d1.1x8)") << p;
  }
}

// A replica waits for the reducer beyond a fixed timeout as long as the
// transfers take at the outer pace: its pseudo-gradient up, the reducer's
// deadline, and the mean down to each of the reducer's replicas in turn;
// before it has adopted the outer state, that state's bytes instead.
TEST_F(OuterSyncTest, AReplicaWaitsForTheMeanWhatItsTransfersTakeAtThePace) {
  OuterSyncOptions options = Options(4, 0, 2, 2, false, 0, absl::Seconds(10));
  options.transfer_time = [](uint64_t bytes) { return absl::Seconds(bytes); };  // 1 B/s
  options.share_state = true;
  options.state_bytes = 1000;
  Make(3, options);
  // No state adopted: three senders, the state goes to two replicas.
  EXPECT_EQ(syncs_[1]->WaitAllowance(), absl::Seconds(10) + absl::Seconds(2 * 1000));
  ASSERT_TRUE(syncs_[0]->Start(now_).ok());
  Deliver();
  for (int step = 1; step <= 2; ++step) ASSERT_TRUE(syncs_[1]->AfterStep(step, 8, now_).ok());
  EXPECT_TRUE(syncs_[1]->MustWait());
  const int64_t bytes = static_cast<int64_t>(Payload("d1.1")[0].ByteSizeLong());
  ASSERT_GT(bytes, 0);
  EXPECT_EQ(syncs_[1]->WaitAllowance(),
            absl::Seconds(bytes) + absl::Seconds(10) + absl::Seconds(2 * bytes));
  // Unpaced: the reducer's deadline alone.
  OuterSyncOptions unpaced = Options(4, 0, 2, 2, false, 0, absl::Seconds(10));
  unpaced.state_bytes = 1000;
  FakeCompute compute(1);
  Wire wire(&queue_, 1);
  OuterSync sync(unpaced, 1, {0, 1}, &compute, &wire);
  EXPECT_EQ(sync.WaitAllowance(), absl::Seconds(10));
}

// A replica that trails (its round had not ended when the reducer closed
// it) takes the mean as it comes and catches up to the outer weights; it
// sends nothing for that round when it gets there.
TEST_F(OuterSyncTest, AReplicaThatTrailsTakesTheMeansAsTheyComeAndCatchesUp) {
  Make(2, Options(1, 0, 1, 1, false, 0, absl::Seconds(1)));
  for (int step = 1; step <= 3; ++step) {
    ASSERT_TRUE(syncs_[0]->AfterStep(step, 4, now_).ok());
    now_ += absl::Seconds(2);
    ASSERT_TRUE(syncs_[0]->OnTime(now_).ok());  // closes the round without pipeline 1
  }
  Deliver();  // pipeline 1 has the means of three rounds it has not ended
  EXPECT_EQ(computes_[1]->applied,
            std::vector<std::string>({"mean(d0.1x4)", "mean(d0.2x4)", "mean(d0.3x4)"}));
  EXPECT_EQ(syncs_[1]->rounds_applied(), 3);
  for (int step = 1; step <= 3; ++step) ASSERT_TRUE(syncs_[1]->AfterStep(step, 4, now_).ok());
  EXPECT_TRUE(queue_.empty());  // no late pseudo-gradient for closed rounds
  EXPECT_FALSE(syncs_[1]->MustWait());
  // Round 4 it makes.
  ASSERT_TRUE(syncs_[1]->AfterStep(4, 4, now_).ok());
  ASSERT_TRUE(syncs_[0]->AfterStep(4, 4, now_).ok());
  Deliver();
  EXPECT_EQ(syncs_[0]->members().at(4), std::vector<int>({0, 1}));
  EXPECT_EQ(computes_[1]->applied.back(), "mean(d0.4x4,d1.1x4)");
}

TEST_F(OuterSyncTest, StreamingSyncsEachStageAtItsOffsetAndAppliesARoundLate) {
  // Stage 1 of 2 with H = 4: its rounds end half a round late, at steps 6,
  // 10, ... (stage 0's at 4, 8, ...).
  Make(2, Options(1, 1, 2, 4, /*streaming=*/true));
  EXPECT_FALSE(syncs_[0]->RoundEndingAt(2).has_value());
  EXPECT_FALSE(syncs_[0]->RoundEndingAt(4).has_value());
  EXPECT_EQ(syncs_[0]->RoundEndingAt(6), 1);
  EXPECT_EQ(syncs_[0]->RoundEndingAt(10), 2);
  // The reducer ends round 1 alone (the replica's contribution is late) and
  // nobody waits; it closes round 1 when its own round 2 ends.
  for (int step = 1; step <= 6; ++step) ASSERT_TRUE(syncs_[0]->AfterStep(step, 4, now_).ok());
  EXPECT_FALSE(syncs_[0]->MustWait());
  EXPECT_TRUE(computes_[0]->applied.empty());
  for (int step = 7; step <= 10; ++step) ASSERT_TRUE(syncs_[0]->AfterStep(step, 4, now_).ok());
  EXPECT_EQ(computes_[0]->applied, std::vector<std::string>({"mean(d0.1x4)"}));
  EXPECT_TRUE(computes_[0]->kept_progress[0]);  // the inner steps since stay
  for (int step = 1; step <= 6; ++step) ASSERT_TRUE(syncs_[1]->AfterStep(step, 4, now_).ok());
  EXPECT_FALSE(syncs_[1]->MustWait());  // round 1 ended: no waiting for its mean
  for (int step = 7; step <= 10; ++step) ASSERT_TRUE(syncs_[1]->AfterStep(step, 4, now_).ok());
  // Round 2 is due, but its pseudo-gradient is measured from round 1's
  // outer weights, whose mean has not come: the replica waits for it.
  EXPECT_TRUE(syncs_[1]->MustWait());
  Deliver();
  EXPECT_FALSE(syncs_[1]->MustWait());
  // Round 1's late contribution was dropped; round 2 has both.
  EXPECT_EQ(syncs_[0]->members().at(1), std::vector<int>({0}));
  EXPECT_EQ(syncs_[0]->members().at(2), std::vector<int>({0, 1}));
  const std::vector<std::string> both = {"mean(d0.1x4)", "mean(d0.2x4,d1.2x4)"};
  EXPECT_EQ(computes_[0]->applied, both);
  EXPECT_EQ(computes_[1]->applied, both);
}

// Streaming keeps the inner steps taken since a round's export on top of
// its mean, but not in the final round: a replica whose contribution missed
// it (it trailed past the reducer's deadline) ends on the outer weights like
// the others, and nothing of its own is left on top.
TEST_F(OuterSyncTest, TheFinalRoundsMeanLeavesNoLocalProgressEvenForAReplicaThatMissedIt) {
  OuterSyncOptions options = Options(1, 0, 1, 2, /*streaming=*/true, 0, absl::Seconds(1));
  options.final_step = 4;
  Make(2, options);
  for (int step = 1; step <= 4; ++step) ASSERT_TRUE(syncs_[0]->AfterStep(step, 4, now_).ok());
  for (int step = 1; step <= 2; ++step) ASSERT_TRUE(syncs_[1]->AfterStep(step, 4, now_).ok());
  Deliver();
  // Round 1 closed with both at the reducer's round 2; the final round
  // (2) waits for pipeline 1 until its deadline, then closes without it.
  now_ += absl::Seconds(2);
  ASSERT_TRUE(syncs_[0]->OnTime(now_).ok());
  Deliver();
  for (int p = 0; p < 2; ++p) {
    ASSERT_EQ(computes_[p]->applied.size(), 2u) << p;
    EXPECT_TRUE(computes_[p]->kept_progress[0]) << p;
    EXPECT_FALSE(computes_[p]->kept_progress[1]) << p;  // the final round
    EXPECT_TRUE(syncs_[p]->finished()) << p;
  }
  EXPECT_EQ(syncs_[0]->members().at(2), std::vector<int>({0}));
  EXPECT_EQ(computes_[1]->applied[1], computes_[0]->applied[1]);
}

TEST_F(OuterSyncTest, ReplicasTakeTheReducersStateBeforeTheirFirstRound) {
  OuterSyncOptions options = Options(3, 0, 1, 2);
  options.share_state = true;
  Make(2, options);
  ASSERT_TRUE(syncs_[1]->Start(now_).ok());  // a replica sends nothing
  EXPECT_TRUE(queue_.empty());
  // The replica reaches its round's end before the state came: it waits,
  // and takes no pseudo-gradient yet.
  for (int step = 1; step <= 2; ++step) ASSERT_TRUE(syncs_[1]->AfterStep(step, 4, now_).ok());
  EXPECT_TRUE(syncs_[1]->MustWait());
  ASSERT_TRUE(syncs_[0]->Start(now_).ok());
  ASSERT_EQ(queue_.size(), 1u);
  EXPECT_EQ(queue_.front().message.kind, OuterMessage::Kind::kState);
  Deliver();
  EXPECT_EQ(computes_[1]->adopted, std::vector<std::string>({"state0@0"}));
  for (int step = 1; step <= 2; ++step) ASSERT_TRUE(syncs_[0]->AfterStep(step, 4, now_).ok());
  Deliver();
  // Its pseudo-gradient was taken after it adopted the state, and made the
  // round.
  EXPECT_EQ(syncs_[0]->members().at(1), std::vector<int>({0, 1}));
  EXPECT_FALSE(syncs_[1]->MustWait());
  // A second state, or one from a replica, is refused.
  OuterMessage again;
  again.kind = OuterMessage::Kind::kState;
  again.epoch = 3;
  again.pipeline = 0;
  again.layers = Payload("state0");
  EXPECT_TRUE(absl::IsInvalidArgument(syncs_[1]->OnMessage(again, now_)));
  again.pipeline = 1;
  EXPECT_TRUE(absl::IsInvalidArgument(syncs_[0]->OnMessage(again, now_)));
}

TEST_F(OuterSyncTest, AStartStepAfterSomeRoundsStartsThere) {
  Make(2, Options(2, 0, 1, 3, false, /*start_step=*/7));
  for (int step = 8; step <= 9; ++step) {
    for (auto& s : syncs_) ASSERT_TRUE(s->AfterStep(step, 1, now_).ok());
  }
  Deliver();
  EXPECT_EQ(computes_[1]->applied.size(), 1u);
  EXPECT_EQ(syncs_[1]->members().count(3), 1u);  // round 3: steps 7-9
}

// A re-plan the reducer's pipeline goes on through: pipeline 1's replica
// leaves (its rounds close on the reducer alone, nothing waits), and the
// replica of pipeline 1 formed anew in epoch 3 attaches. It takes the
// reducer's state and round, contributes from its next round on, and
// messages of the old link's epoch are refused.
TEST_F(OuterSyncTest, AReplicaFormedAnewAttachesAndTakesTheReducersRounds) {
  Make(2, Options(1, 0, 1, 2));
  for (int step = 1; step <= 2; ++step) {
    for (auto& s : syncs_) ASSERT_TRUE(s->AfterStep(step, 4, now_).ok());
  }
  Deliver();
  ASSERT_EQ(syncs_[0]->rounds_applied(), 1);
  ASSERT_TRUE(syncs_[0]->Leave(1, now_).ok());
  for (int step = 3; step <= 4; ++step) ASSERT_TRUE(syncs_[0]->AfterStep(step, 4, now_).ok());
  EXPECT_FALSE(syncs_[0]->MustWait());  // round 2 closed on the reducer alone
  EXPECT_EQ(syncs_[0]->members().at(2), std::vector<int>({0}));
  queue_.clear();
  // Pipeline 1 formed anew in epoch 3, at step 4.
  OuterSyncOptions fresh = Options(3, 0, 1, 2, false, /*start_step=*/4);
  fresh.share_state = true;
  fresh.link_epochs[0] = 3;
  computes_[1] = std::make_unique<FakeCompute>(1);
  syncs_[1] = std::make_unique<OuterSync>(fresh, 1, std::set<int>{0, 1}, computes_[1].get(),
                                          wires_[1].get());
  ASSERT_TRUE(syncs_[0]->Attach(1, 3, now_).ok());
  ASSERT_EQ(queue_.size(), 1u);
  EXPECT_EQ(queue_.front().message.kind, OuterMessage::Kind::kState);
  EXPECT_EQ(queue_.front().message.epoch, 3u);
  EXPECT_EQ(queue_.front().message.round, 2);
  Deliver();
  EXPECT_EQ(computes_[1]->adopted, std::vector<std::string>({"state0@2"}));
  EXPECT_EQ(syncs_[1]->rounds_applied(), 2);
  for (int step = 5; step <= 6; ++step) {
    for (auto& s : syncs_) ASSERT_TRUE(s->AfterStep(step, 4, now_).ok());
  }
  Deliver();
  EXPECT_EQ(syncs_[0]->members().at(3), std::vector<int>({0, 1}));
  EXPECT_EQ(computes_[1]->applied.back(), computes_[0]->applied.back());
  // The old link's epoch is gone.
  OuterMessage old;
  old.kind = OuterMessage::Kind::kDelta;
  old.epoch = 1;
  old.pipeline = 1;
  old.round = 4;
  old.layers = Payload("d1.old");
  EXPECT_TRUE(absl::IsInvalidArgument(syncs_[0]->OnMessage(old, now_)));
  // A replica whose reducer left trains on alone, and waits for a new
  // reducer's state once one attaches.
  ASSERT_TRUE(syncs_[1]->Leave(0, now_).ok());
  EXPECT_TRUE(syncs_[1]->detached());
  ASSERT_TRUE(syncs_[1]->Attach(0, 5, now_).ok());
  for (int step = 7; step <= 8; ++step) ASSERT_TRUE(syncs_[1]->AfterStep(step, 4, now_).ok());
  EXPECT_TRUE(syncs_[1]->MustWait());
}

TEST_F(OuterSyncTest, MessagesThatDoNotBelongAreRefused) {
  Make(3, Options(4, 1, 2, 1));
  OuterMessage delta;
  delta.kind = OuterMessage::Kind::kDelta;
  delta.epoch = 4;
  delta.stage = 1;
  delta.round = 1;
  delta.pipeline = 1;
  delta.layers = Payload("d");
  ASSERT_TRUE(syncs_[0]->OnMessage(delta, now_).ok());
  EXPECT_EQ(syncs_[0]->OnMessage(delta, now_).code(), absl::StatusCode::kInvalidArgument)
      << "a second contribution";
  OuterMessage other = delta;
  other.epoch = 3;
  EXPECT_EQ(syncs_[0]->OnMessage(other, now_).code(), absl::StatusCode::kInvalidArgument);
  other = delta;
  other.pipeline = 7;
  EXPECT_EQ(syncs_[0]->OnMessage(other, now_).code(), absl::StatusCode::kInvalidArgument);
  other = delta;
  other.round = 40;
  other.pipeline = 2;
  EXPECT_EQ(syncs_[0]->OnMessage(other, now_).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(syncs_[2]->OnMessage(delta, now_).code(), absl::StatusCode::kInvalidArgument)
      << "a contribution to a replica that does not reduce";
  OuterMessage mean = delta;
  mean.kind = OuterMessage::Kind::kMean;
  EXPECT_EQ(syncs_[2]->OnMessage(mean, now_).code(), absl::StatusCode::kInvalidArgument)
      << "a mean not from the reducer";
  mean.pipeline = 0;
  mean.contributors = {0, 9};
  EXPECT_EQ(syncs_[2]->OnMessage(mean, now_).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(computes_[2]->applied.empty());
}

}  // namespace
}  // namespace geotrain
