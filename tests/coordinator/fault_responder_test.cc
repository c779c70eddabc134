// FaultResponder on its own: members on a FakeClock, a hand-made plan, a
// ProgressTracker with no reports. Its Actions are looked at, not applied.
#include "coordinator/fault_responder.h"

#include <gtest/gtest.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/job_spec.h"

namespace geotrain {
namespace {

using Kind = FaultResponder::Action::Kind;

class FaultResponderTest : public testing::Test {
 protected:
  void SetUp() override {
    auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} "
                            "steps: 200 min_workers: 3",
                            "test");
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *job;
    EventLogOptions events;
    events.clock = &clock_;
    events_ = std::make_unique<EventLog>(std::move(events));
    for (const char* name : {"a", "b", "c", "spare"}) ids_.push_back(membership_.Join(name, "h:1", {}).id);
    relay_ = membership_.Join("relay", "r:1", {}, "", v1::MEMBER_ROLE_RELAY).id;
    // Three stages a, b, c; b's link to c runs through the relay.
    plan_.set_epoch(4);
    for (int stage = 0; stage < 3; ++stage) {
      v1::StageAssignment* s = plan_.add_stages();
      s->set_stage(stage);
      s->set_worker_id(ids_[stage]);
    }
    v1::PlannedLink* relayed = plan_.add_links();
    relayed->set_upstream_worker(ids_[1]);
    relayed->set_downstream_worker(ids_[2]);
    relayed->set_dialer(v1::LINK_DIALER_RELAY);
    relayed->set_relay_worker(relay_);
    ProgressTrackerOptions progress;
    progress.job = &job_;
    progress.clock = &clock_;
    progress.membership = &membership_;
    progress.plan = &view_;
    progress.events = events_.get();
    progress_ = std::make_unique<ProgressTracker>(progress);
    progress_->StartEpoch(plan_);
    FaultResponderOptions options;
    options.clock = &clock_;
    options.membership = &membership_;
    options.progress = progress_.get();
    options.reachability = &reachability_;
    options.events = events_.get();
    options.total_steps = 200;
    options.authenticated_callers = true;
    options.events_per_s = 1;
    options.event_burst = 3;
    faults_ = std::make_unique<FaultResponder>(options);
  }

  v1::WorkerEvent LinkLost(const std::string& from, const std::string& peer) {
    v1::WorkerEvent event;
    event.set_worker_id(from);
    event.set_kind("link_lost");
    event.set_peer(peer);
    event.set_epoch(plan_.epoch());
    return event;
  }

  int EventsOf(const std::string& kind) {
    int n = 0;
    for (const v1::Event& e : events_->Recent()) n += e.kind() == kind;
    return n;
  }

  FakeClock clock_{1000};
  v1::JobSpec job_;
  Membership membership_{&clock_, 5000};
  ReachabilityManager reachability_{&membership_, 2};
  std::unique_ptr<EventLog> events_;
  PlanView view_;
  std::unique_ptr<ProgressTracker> progress_;
  std::unique_ptr<FaultResponder> faults_;
  v1::Plan plan_;
  std::vector<std::string> ids_;
  std::string relay_;
};

TEST_F(FaultResponderTest, EventsAreRateLimitedAndStrangersRefused) {
  v1::WorkerEvent event;
  event.set_worker_id(ids_[0]);
  event.set_kind("restore");
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(faults_->Admit(event).ok()) << i;
  EXPECT_EQ(faults_->Admit(event).code(), absl::StatusCode::kResourceExhausted);
  clock_.AdvanceMs(1000);  // one more token
  EXPECT_TRUE(faults_->Admit(event).ok());
  EXPECT_EQ(EventsOf("restore"), 4);
  event.set_worker_id("w99");
  EXPECT_EQ(faults_->Admit(event).code(), absl::StatusCode::kPermissionDenied);
  event.set_worker_id(ids_[0]);
  event.set_kind(std::string(65, 'k'));
  EXPECT_EQ(faults_->Admit(event).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(FaultResponderTest, ALostLinkTakesOutTheAccusedOnceAndOnlyBetweenNeighbours) {
  absl::StatusOr<std::optional<FaultResponder::Action>> action =
      faults_->OnWorkerEvent(LinkLost(ids_[0], ids_[1]), plan_, plan_.epoch());
  ASSERT_TRUE(action.ok());
  ASSERT_TRUE(action->has_value());
  EXPECT_EQ((*action)->kind, Kind::kTakeOut);
  EXPECT_EQ((*action)->worker_id, ids_[1]);
  EXPECT_TRUE((*action)->broken_link);
  // The other end of the same link accuses back: counted already.
  action = faults_->OnWorkerEvent(LinkLost(ids_[1], ids_[0]), plan_, plan_.epoch());
  ASSERT_TRUE(action.ok());
  EXPECT_FALSE(action->has_value());
  // Stage 0 accusing stage 2: not neighbours.
  action = faults_->OnWorkerEvent(LinkLost(ids_[0], ids_[2]), plan_, plan_.epoch());
  EXPECT_EQ(action.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(EventsOf("accusation_refused"), 1);
  // A link of an older epoch is old news.
  action = faults_->OnWorkerEvent(LinkLost(ids_[1], ids_[2]), plan_, plan_.epoch() + 1);
  ASSERT_TRUE(action.ok());
  EXPECT_FALSE(action->has_value());
}

TEST_F(FaultResponderTest, ALostLinkThroughARelayRelinksOnceASecond) {
  absl::StatusOr<std::optional<FaultResponder::Action>> action =
      faults_->OnWorkerEvent(LinkLost(ids_[1], relay_), plan_, plan_.epoch());
  ASSERT_TRUE(action.ok());
  ASSERT_TRUE(action->has_value());
  EXPECT_EQ((*action)->kind, Kind::kRelink);
  action = faults_->OnWorkerEvent(LinkLost(ids_[2], relay_), plan_, plan_.epoch());
  ASSERT_TRUE(action.ok());
  EXPECT_FALSE(action->has_value()) << "the other end of the same link";
  EXPECT_TRUE(reachability_.UsableRelays().empty()) << "suspended until it heartbeats";
}

TEST_F(FaultResponderTest, ATakenOutWorkerStandsByAfterItsNextHeartbeatAndReplicatesLater) {
  std::optional<WorkerRecord> b = membership_.Find(ids_[1]);
  ASSERT_TRUE(faults_->EligibleStandby(*b));
  ASSERT_TRUE(faults_->MayReplicate(ids_[1]));
  faults_->MarkTakenOut(ids_[1]);
  EXPECT_FALSE(faults_->EligibleStandby(*membership_.Find(ids_[1])));
  EXPECT_FALSE(faults_->MayReplicate(ids_[1]));
  clock_.AdvanceMs(10);
  ASSERT_TRUE(membership_.Heartbeat(ids_[1], 0, 0));
  EXPECT_TRUE(faults_->EligibleStandby(*membership_.Find(ids_[1])));
  EXPECT_FALSE(faults_->MayReplicate(ids_[1])) << "for 30 s";
  clock_.AdvanceMs(30000);
  EXPECT_TRUE(faults_->MayReplicate(ids_[1]));
}

TEST_F(FaultResponderTest, TheWatchdogFollowsWhomTheWorkersWaitOn) {
  // `ms` pass with every worker heartbeating each second; a says it has
  // waited on b for 10 s.
  v1::StageStats waiting;
  waiting.set_waiting_on(ids_[1]);
  waiting.set_waiting_s(10);
  auto pass = [&](int64_t ms, bool a_waits) {
    for (int64_t t = 0; t < ms; t += 1000) {
      clock_.AdvanceMs(1000);
      for (const std::string& id : ids_) {
        ASSERT_TRUE(membership_.Heartbeat(id, 0, 0, id == ids_[0] && a_waits ? waiting
                                                                             : v1::StageStats()));
      }
    }
  };
  // Nothing for the start-up grace: no action.
  pass(59000, false);
  EXPECT_FALSE(faults_->CheckProgress(plan_).has_value());
  // Then a stall: a waits on b, which waits on nobody.
  pass(2000, true);
  std::optional<FaultResponder::Action> stall = faults_->CheckProgress(plan_);
  ASSERT_TRUE(stall.has_value());
  EXPECT_EQ(stall->worker_id, ids_[1]);
  EXPECT_TRUE(stall->broken_link);
  EXPECT_EQ(EventsOf("stalled"), 1);
  // One action per stall period.
  EXPECT_FALSE(faults_->CheckProgress(plan_).has_value());
}

}  // namespace
}  // namespace geotrain
