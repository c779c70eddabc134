// Runs real PipelineDrivers and StageRuntimes for every stage in one
// process, connected by in-memory links, over each schedule. Proves the
// stash bookkeeping end to end: every backward used its forward's weight
// version (the runtime checks it and fails otherwise), versions alive stay
// within the schedule's bound over hundreds of microbatches, and all stashed
// versions are freed at the end.
#include "worker/pipeline_driver.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <fstream>
#include <set>
#include <thread>

#include "common/job_spec.h"

namespace geotrain {
namespace {

// Delivers messages into another stage's inbox.
class InboxSink : public MessageSink {
 public:
  InboxSink(Inbox* inbox, bool from_upstream) : inbox_(inbox), from_upstream_(from_upstream) {}
  absl::Status Send(LinkMessage message) override {
    if (!inbox_->Push({from_upstream_, std::move(message), absl::OkStatus()})) {
      return absl::UnavailableError("closed");
    }
    return absl::OkStatus();
  }

 private:
  Inbox* inbox_;
  bool from_upstream_;
};

class RecordingProgress : public ProgressSink {
 public:
  void StepFinished(int step, double loss, int64_t) override {
    absl::MutexLock lock(&mu_);
    losses_.push_back(loss);
    steps_.push_back(step);
  }
  void EvalFinished(int, const EvalResult& result) override {
    absl::MutexLock lock(&mu_);
    evals_.push_back(result.loss);
  }
  void StageProgress(int) override {}
  std::vector<double> evals() {
    absl::MutexLock lock(&mu_);
    return evals_;
  }
  std::vector<double> losses() {
    absl::MutexLock lock(&mu_);
    return losses_;
  }
  std::vector<int> steps() {
    absl::MutexLock lock(&mu_);
    return steps_;
  }

 private:
  absl::Mutex mu_;
  std::vector<double> losses_;
  std::vector<int> steps_;
  std::vector<double> evals_;
};

struct PipelineRun {
  std::vector<StashStats> stash;
  std::vector<v1::StageStats> stats;
  std::vector<double> losses;
  std::vector<int> steps;
  std::vector<double> evals;
};

v1::JobSpec MakeJob(const std::string& corpus, v1::Schedule schedule) {
  auto job = ParseJobSpec(
      "gpt { context: 16 d_model: 32 heads: 4 blocks: 2 } text { paths: \"" + corpus +
          "\" } steps: 60 microbatches: 4 microbatch_size: 4 seed: 3 eval_every: 20 "
          "eval_batches: 2",
      "test");
  EXPECT_TRUE(job.ok()) << job.status();
  job->set_schedule(schedule);
  return *job;
}

// Layers per stage for a 4-layer model on `stages` stages.
std::vector<std::pair<int, int>> Split(int stages) {
  if (stages == 1) return {{0, 4}};
  if (stages == 2) return {{0, 2}, {2, 4}};
  return {{0, 1}, {1, 3}, {3, 4}};
}

PipelineRun RunPipeline(const v1::JobSpec& job, int stages, size_t inbox_capacity = 64) {
  const ScheduleConfig schedule = ConfigureSchedule(job, stages);
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  std::vector<std::unique_ptr<Inbox>> inboxes;
  for (int s = 0; s < stages; ++s) {
    RuntimeOptions options;
    options.max_weight_versions = schedule.max_weight_versions;
    auto runtime = StageRuntime::Create(job, {s, stages, Split(stages)[s].first,
                                              Split(stages)[s].second},
                                        options);
    EXPECT_TRUE(runtime.ok()) << runtime.status();
    runtimes.push_back(std::move(*runtime));
    inboxes.push_back(std::make_unique<Inbox>(inbox_capacity));
  }
  std::vector<std::unique_ptr<InboxSink>> sinks;
  RecordingProgress progress;
  std::vector<StatsBoard> boards(stages);
  std::vector<absl::Status> results(stages);
  std::vector<std::thread> threads;
  for (int s = 0; s < stages; ++s) {
    MessageSink* up = nullptr;
    MessageSink* down = nullptr;
    if (s > 0) {
      sinks.push_back(std::make_unique<InboxSink>(inboxes[s - 1].get(), false));
      up = sinks.back().get();
    }
    if (s + 1 < stages) {
      sinks.push_back(std::make_unique<InboxSink>(inboxes[s + 1].get(), true));
      down = sinks.back().get();
    }
    PipelineDriverOptions options;
    options.stage = s;
    options.num_stages = stages;
    options.schedule = schedule;
    threads.emplace_back([&, s, up, down, options] {
      PipelineDriver driver(job, options, runtimes[s].get(), up, down, inboxes[s].get(),
                            &progress, &boards[s]);
      results[s] = driver.Run();
      if (!results[s].ok()) {
        for (auto& inbox : inboxes) inbox->Close();  // unblock the others
      }
    });
  }
  for (std::thread& t : threads) t.join();
  PipelineRun run;
  for (int s = 0; s < stages; ++s) {
    EXPECT_TRUE(results[s].ok()) << "stage " << s << ": " << results[s];
    run.stash.push_back(runtimes[s]->stash_stats());
    run.stats.push_back(boards[s].Get());
  }
  run.losses = progress.losses();
  run.steps = progress.steps();
  run.evals = progress.evals();
  return run;
}

class PipelineDriverTest : public testing::TestWithParam<v1::Schedule> {
 protected:
  static void SetUpTestSuite() {
    // One file per process: ctest runs this binary's tests in parallel.
    corpus_ = new std::string(testing::TempDir() + "/pipeline_driver_corpus." +
                              std::to_string(getpid()) + ".txt");
    std::ofstream out(*corpus_);
    for (int i = 0; i < 500; ++i) out << "pack my box with five dozen liquor jugs " << i << "\n";
  }
  static std::string* corpus_;
};
std::string* PipelineDriverTest::corpus_ = nullptr;

TEST_P(PipelineDriverTest, StashStaysWithinBoundAndIsFreed) {
  const v1::JobSpec job = MakeJob(*corpus_, GetParam());
  constexpr int kStages = 3;
  const ScheduleConfig schedule = ConfigureSchedule(job, kStages);
  const PipelineRun run = RunPipeline(job, kStages);
  const int64_t microbatches = int64_t{job.steps()} * job.microbatches();
  ASSERT_GE(microbatches, 200);
  ASSERT_EQ(run.steps.size(), static_cast<size_t>(job.steps()));
  for (int s = 0; s < kStages; ++s) {
    const StashStats& stash = run.stash[s];
    SCOPED_TRACE(testing::Message() << "stage " << s);
    // Every backward was checked against its forward's version.
    EXPECT_EQ(stash.backwards_checked, microbatches);
    EXPECT_LE(stash.max_versions_alive, schedule.max_weight_versions);
    // All stashed versions freed: only the current one is left, unreferenced.
    EXPECT_EQ(stash.versions_alive, 1);
    EXPECT_EQ(stash.references, 0);
    EXPECT_EQ(stash.current_version, microbatches / schedule.update_every);
    EXPECT_EQ(run.stats[s].microbatches(), microbatches);
    EXPECT_EQ(run.stats[s].max_weight_versions(), stash.max_versions_alive);
  }
  switch (GetParam()) {
    case v1::SCHEDULE_SYNC:
      EXPECT_EQ(schedule.max_weight_versions, 1);
      for (const StashStats& s : run.stash) EXPECT_EQ(s.staleness_max, 0);
      break;
    case v1::SCHEDULE_ASYNC_STASH:
      EXPECT_EQ(schedule.max_weight_versions, kStages);
      // Stage 0 really ran ahead: its backwards saw newer weights than their
      // forwards, and it needed more than one version.
      EXPECT_GT(run.stash[0].staleness_max, 0);
      EXPECT_GT(run.stash[0].max_versions_alive, 1);
      EXPECT_EQ(run.stash[kStages - 1].staleness_max, 0);
      break;
    case v1::SCHEDULE_ASYNC_2BW:
      EXPECT_EQ(schedule.max_weight_versions, 2);
      EXPECT_EQ(run.stash[0].max_versions_alive, 2);
      EXPECT_LE(run.stash[0].staleness_max, 1);
      break;
    default:
      FAIL();
  }
  // It learned something.
  EXPECT_LT(run.losses.back(), run.losses.front());
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineDriverTest,
                         testing::Values(v1::SCHEDULE_SYNC, v1::SCHEDULE_ASYNC_STASH,
                                         v1::SCHEDULE_ASYNC_2BW),
                         [](const testing::TestParamInfo<v1::Schedule>& info) {
                           return std::string(info.param == v1::SCHEDULE_SYNC ? "sync"
                                              : info.param == v1::SCHEDULE_ASYNC_STASH
                                                  ? "async_stash"
                                                  : "async_2bw");
                         });

TEST_F(PipelineDriverTest, SyncOverThreeStagesMatchesOneStage) {
  v1::JobSpec job = MakeJob(*corpus_, v1::SCHEDULE_SYNC);
  job.set_steps(10);
  const PipelineRun one = RunPipeline(job, 1);
  const PipelineRun three = RunPipeline(job, 3);
  ASSERT_EQ(one.losses.size(), 10u);
  ASSERT_EQ(three.losses.size(), 10u);
  for (size_t i = 0; i < one.losses.size(); ++i) {
    EXPECT_NEAR(three.losses[i], one.losses[i], 1e-4 * std::abs(one.losses[i])) << "step " << i;
  }
  // The final evaluation (its microbatches through the window) too.
  ASSERT_EQ(one.evals.size(), 1u);
  ASSERT_EQ(three.evals.size(), 1u);
  EXPECT_NEAR(three.evals[0], one.evals[0], 1e-4 * std::abs(one.evals[0]));
}

// An evaluation pass far larger than the queues, in the middle of async
// training over 3 stages, completes. Sent as a burst, its forwards could
// close a cycle of full queues (stage 1 blocked sending forwards to stage
// 2, stage 2 blocked sending a gradient back); counted in the window until
// acknowledged, they never hold more places than training would.
TEST_F(PipelineDriverTest, EvaluationBurstLargerThanTheQueuesDoesNotDeadlock) {
  v1::JobSpec job = MakeJob(*corpus_, v1::SCHEDULE_ASYNC_STASH);
  job.set_steps(12);
  job.set_eval_every(3);
  job.set_eval_batches(40);
  const PipelineRun run = RunPipeline(job, 3, /*inbox_capacity=*/4);
  EXPECT_EQ(run.steps.size(), 12u);
  for (const StashStats& s : run.stash) EXPECT_EQ(s.references, 0);
}

// Holds the gradients its stage sends upstream from microbatch `from` on,
// until an evaluation microbatch has gone down the pipeline (or 20 s
// passed, which the test counts as a failure).
class EvalGate {
 public:
  explicit EvalGate(uint64_t from) : from_(from) {}
  void SawEval() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  // False if the gate had to open by itself.
  bool Pass(const LinkMessage& message) {
    if (message.header.kind() != v1::MESSAGE_KIND_GRADIENT || message.header.microbatch() < from_) {
      return true;
    }
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&open_), absl::Seconds(20))) return true;
    open_ = true;
    timed_out_ = true;
    return false;
  }
  bool timed_out() {
    absl::MutexLock lock(&mu_);
    return timed_out_;
  }

 private:
  const uint64_t from_;
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  bool timed_out_ ABSL_GUARDED_BY(mu_) = false;
};

class GatedSink : public MessageSink {
 public:
  GatedSink(MessageSink* next, EvalGate* gate, bool watches_evals)
      : next_(next), gate_(gate), watches_evals_(watches_evals) {}
  absl::Status Send(LinkMessage message) override {
    if (watches_evals_ && message.header.kind() == v1::MESSAGE_KIND_EVAL) gate_->SawEval();
    if (!watches_evals_) gate_->Pass(message);
    return next_->Send(std::move(message));
  }

 private:
  MessageSink* next_;
  EvalGate* gate_;
  const bool watches_evals_;
};

// Under async-stash, stage 0 evaluates without draining: the gradient of
// the first microbatch after the evaluation's step boundary is held back
// until an evaluation microbatch went down. A driver that waited for its
// microbatches in flight before evaluating would wait for that gradient
// (the gate then opens by itself after 20 s, and the test fails).
TEST_F(PipelineDriverTest, AsyncEvaluationStartsWithMicrobatchesInFlight) {
  v1::JobSpec job = MakeJob(*corpus_, v1::SCHEDULE_ASYNC_STASH);
  job.set_steps(6);
  job.set_eval_every(3);
  const ScheduleConfig schedule = ConfigureSchedule(job, 2);
  ASSERT_GE(schedule.window, 2);
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  std::vector<std::unique_ptr<Inbox>> inboxes;
  for (int s = 0; s < 2; ++s) {
    RuntimeOptions options;
    options.max_weight_versions = schedule.max_weight_versions;
    auto runtime = StageRuntime::Create(job, {s, 2, Split(2)[s].first, Split(2)[s].second},
                                        options);
    ASSERT_TRUE(runtime.ok()) << runtime.status();
    runtimes.push_back(std::move(*runtime));
    inboxes.push_back(std::make_unique<Inbox>(64));
  }
  EvalGate gate(/*from=*/uint64_t{3} * job.microbatches());
  InboxSink to_last(inboxes[1].get(), /*from_upstream=*/true);
  InboxSink to_first(inboxes[0].get(), /*from_upstream=*/false);
  GatedSink down(&to_last, &gate, /*watches_evals=*/true);
  GatedSink up(&to_first, &gate, /*watches_evals=*/false);
  RecordingProgress progress;
  std::vector<StatsBoard> boards(2);
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  for (int s = 0; s < 2; ++s) {
    PipelineDriverOptions options;
    options.stage = s;
    options.num_stages = 2;
    options.schedule = schedule;
    threads.emplace_back([&, s, options] {
      PipelineDriver driver(job, options, runtimes[s].get(), s == 1 ? &up : nullptr,
                            s == 0 ? &down : nullptr, inboxes[s].get(), &progress, &boards[s]);
      results[s] = driver.Run();
      if (!results[s].ok()) {
        for (auto& inbox : inboxes) inbox->Close();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int s = 0; s < 2; ++s) ASSERT_TRUE(results[s].ok()) << s << ": " << results[s];
  EXPECT_FALSE(gate.timed_out()) << "stage 0 waited for its microbatches in flight";
  EXPECT_EQ(progress.steps().size(), 6u);
  const std::vector<double> evals = progress.evals();
  ASSERT_EQ(evals.size(), 2u);  // steps 3 and 6
  for (double loss : evals) EXPECT_GT(loss, 0);
  for (int s = 0; s < 2; ++s) EXPECT_EQ(runtimes[s]->stash_stats().references, 0);
}

TEST(ConfigureScheduleTest, KnobsFollowTheJob) {
  v1::JobSpec job;
  job.set_microbatches(4);
  job.set_schedule(v1::SCHEDULE_SYNC);
  ScheduleConfig sync = ConfigureSchedule(job, 3);
  EXPECT_EQ(sync.window, 3);
  EXPECT_EQ(sync.update_every, 4);
  EXPECT_TRUE(sync.flush);

  job.set_schedule(v1::SCHEDULE_ASYNC_STASH);
  job.set_update_every(2);
  job.set_in_flight(6);
  ScheduleConfig stash = ConfigureSchedule(job, 3);
  EXPECT_EQ(stash.window, 6);
  EXPECT_EQ(stash.update_every, 2);
  EXPECT_FALSE(stash.flush);
  EXPECT_EQ(stash.max_weight_versions, 6);

  job.set_schedule(v1::SCHEDULE_ASYNC_2BW);
  ScheduleConfig two = ConfigureSchedule(job, 3);
  EXPECT_EQ(two.window, 4) << "capped at M so that two versions suffice";
  EXPECT_EQ(two.update_every, 4);
  EXPECT_EQ(two.max_weight_versions, 2);
}

TEST(ConfigureScheduleTest, ThePlansWindowAppliesWhenTheJobSetsNone) {
  v1::JobSpec job;
  job.set_microbatches(4);
  job.set_schedule(v1::SCHEDULE_ASYNC_STASH);
  EXPECT_EQ(ConfigureSchedule(job, 3, 11).window, 11);  // covers a long round trip
  EXPECT_EQ(ConfigureSchedule(job, 3, 11).max_weight_versions, 11);
  EXPECT_EQ(ConfigureSchedule(job, 3, 1).window, 3) << "never below the stages";
  EXPECT_EQ(ConfigureSchedule(job, 3, 500).window, kMaxPlannedWindow);
  EXPECT_EQ(ConfigureSchedule(job, 3, 0).window, 3);
  job.set_in_flight(6);
  EXPECT_EQ(ConfigureSchedule(job, 3, 11).window, 6) << "the job's own W wins";
}

}  // namespace
}  // namespace geotrain

namespace geotrain {
namespace {

// Stage 0's replicas each send their training activations through one of
// these, which records the microbatch ids.
class RecordingSink : public MessageSink {
 public:
  explicit RecordingSink(MessageSink* next) : next_(next) {}
  absl::Status Send(LinkMessage message) override {
    if (message.header.kind() == v1::MESSAGE_KIND_ACTIVATION) {
      absl::MutexLock lock(&mu_);
      ids_.push_back(message.header.microbatch());
    }
    return next_->Send(std::move(message));
  }
  std::vector<uint64_t> ids() {
    absl::MutexLock lock(&mu_);
    return ids_;
  }

 private:
  MessageSink* next_;
  absl::Mutex mu_;
  std::vector<uint64_t> ids_;
};

// The last stage's way back: each gradient to the replica whose share its
// microbatch id is in, each evaluation acknowledgement to the primary, which
// alone evaluates (what UpstreamLinks does by the sending link).
class ShareRoutingSink : public MessageSink {
 public:
  explicit ShareRoutingSink(std::vector<Inbox*> replicas) : replicas_(std::move(replicas)) {}
  absl::Status Send(LinkMessage message) override {
    Inbox* to = message.header.kind() == v1::MESSAGE_KIND_EVAL_ACK
                    ? replicas_[0]
                    : replicas_[message.header.microbatch() % replicas_.size()];
    if (!to->Push({false, std::move(message), absl::OkStatus()})) return absl::UnavailableError("closed");
    return absl::OkStatus();
  }

 private:
  std::vector<Inbox*> replicas_;
};

TEST_F(PipelineDriverTest, StageZeroReplicasTrainDisjointSharesThatCoverEveryMicrobatch) {
  v1::JobSpec job = MakeJob(*corpus_, v1::SCHEDULE_ASYNC_STASH);
  job.set_steps(15);
  job.set_eval_every(5);
  constexpr int kReplicas = 2;
  const ScheduleConfig schedule = ConfigureSchedule(job, kReplicas + 1);
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  for (int r = 0; r <= kReplicas; ++r) {
    const bool last = r == kReplicas;
    RuntimeOptions options;
    options.max_weight_versions = schedule.max_weight_versions;
    auto runtime = StageRuntime::Create(job, {last ? 1 : 0, 2, last ? 2 : 0, last ? 4 : 2},
                                        options);
    ASSERT_TRUE(runtime.ok()) << runtime.status();
    runtimes.push_back(std::move(*runtime));
  }
  std::vector<std::unique_ptr<Inbox>> inboxes;
  for (int i = 0; i <= kReplicas; ++i) inboxes.push_back(std::make_unique<Inbox>(64));
  InboxSink to_last(inboxes[kReplicas].get(), /*from_upstream=*/true);
  std::vector<std::unique_ptr<RecordingSink>> downs;
  for (int r = 0; r < kReplicas; ++r) downs.push_back(std::make_unique<RecordingSink>(&to_last));
  ShareRoutingSink up({inboxes[0].get(), inboxes[1].get()});
  RecordingProgress progress;
  std::vector<StatsBoard> boards(kReplicas + 1);
  std::vector<absl::Status> results(kReplicas + 1);
  std::vector<std::thread> threads;
  for (int i = 0; i <= kReplicas; ++i) {
    const bool last = i == kReplicas;
    PipelineDriverOptions options;
    options.stage = last ? 1 : 0;
    options.num_stages = 2;
    options.schedule = schedule;
    if (last) {
      options.upstream_workers = kReplicas;
    } else {
      options.replicated = true;
      options.primary = i == 0;
      options.replica_index = i;
      options.stage_replicas = kReplicas;
    }
    threads.emplace_back([&, i, last, options] {
      PipelineDriver driver(job, options, runtimes[i].get(), last ? &up : nullptr,
                            last ? nullptr : downs[i].get(), inboxes[i].get(), &progress,
                            &boards[i]);
      results[i] = driver.Run();
      if (!results[i].ok()) {
        for (auto& inbox : inboxes) inbox->Close();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i <= kReplicas; ++i) ASSERT_TRUE(results[i].ok()) << i << ": " << results[i];

  const int64_t total = int64_t{job.steps()} * job.microbatches();
  std::set<uint64_t> all;
  for (int r = 0; r < kReplicas; ++r) {
    const std::vector<uint64_t> ids = downs[r]->ids();
    // Replica r issued exactly the ids r, r + R, r + 2R, ... below the end.
    ASSERT_EQ(ids.size(), static_cast<size_t>(total / kReplicas)) << "replica " << r;
    for (size_t j = 0; j < ids.size(); ++j) {
      EXPECT_EQ(ids[j], static_cast<uint64_t>(r + kReplicas * j)) << "replica " << r;
    }
    all.insert(ids.begin(), ids.end());
    EXPECT_EQ(boards[r].Get().microbatches(), total / kReplicas);
    EXPECT_EQ(runtimes[r]->stash_stats().references, 0);
  }
  // Disjoint, and together every microbatch once.
  EXPECT_EQ(all.size(), static_cast<size_t>(total));
  EXPECT_EQ(*all.rbegin(), static_cast<uint64_t>(total - 1));
  EXPECT_EQ(boards[kReplicas].Get().microbatches(), total);
  EXPECT_EQ(progress.steps().size(), static_cast<size_t>(job.steps()));
  // Only the primary evaluates: steps 5, 10 and 15, once each.
  EXPECT_EQ(progress.evals().size(), 3u);
  EXPECT_LT(progress.losses().back(), progress.losses().front());
}

// A DONE frame before the job's last step (a hostile or broken upstream
// worker's) ends nothing: the stage refuses it as a failure of the link it
// came on, naming the sender, and reports no step past what it computed.
TEST_F(PipelineDriverTest, AnEarlyDoneIsRefusedAsTheSendersLinkFailing) {
  const v1::JobSpec job = MakeJob(*corpus_, v1::SCHEDULE_ASYNC_STASH);
  auto runtime = StageRuntime::Create(job, {1, 2, 2, 4}, RuntimeOptions());
  ASSERT_TRUE(runtime.ok()) << runtime.status();
  Inbox inbox(8);
  Inbox upstream_inbox(8);
  InboxSink up(&upstream_inbox, false);
  RecordingProgress progress;
  PipelineDriverOptions options;
  options.stage = 1;
  options.num_stages = 2;
  options.schedule = ConfigureSchedule(job, 2);
  InboundMessage done;
  done.from_upstream = true;
  done.message.header.set_kind(v1::MESSAGE_KIND_DONE);
  done.message.header.set_step(job.steps());
  done.peer = "w-liar";
  ASSERT_TRUE(inbox.Push(std::move(done)));
  PipelineDriver driver(job, options, runtime->get(), &up, nullptr, &inbox, &progress);
  const absl::Status ran = driver.Run();
  EXPECT_TRUE(absl::IsUnavailable(ran)) << ran;
  EXPECT_NE(ran.message().find("DONE from w-liar refused"), std::string::npos) << ran;
  EXPECT_EQ(driver.failed_link(), PipelineDriver::FailedLink::kUpstream);
  EXPECT_EQ(driver.failed_peer(), "w-liar");
  EXPECT_TRUE(progress.steps().empty());
}

// Passes the first `keep` activations on, then swallows the rest: a
// downstream worker that holds its stream open and stops answering.
class StallingSink : public MessageSink {
 public:
  StallingSink(MessageSink* next, int keep) : next_(next), keep_(keep) {}
  absl::Status Send(LinkMessage message) override {
    if (message.header.kind() == v1::MESSAGE_KIND_ACTIVATION && keep_-- <= 0) {
      return absl::OkStatus();
    }
    return next_->Send(std::move(message));
  }

 private:
  MessageSink* next_;
  int keep_;
};

// Issue 32: a stalled stream froze training for good. The stage that is
// owed replies gives up on the link after its reply timeout, as if it broke,
// so its report re-plans around the staller.
TEST_F(PipelineDriverTest, AStalledDownstreamEndsTheRunAsABrokenLink) {
  const v1::JobSpec job = MakeJob(*corpus_, v1::SCHEDULE_ASYNC_STASH);
  const ScheduleConfig schedule = ConfigureSchedule(job, 2);
  std::vector<std::unique_ptr<StageRuntime>> runtimes;
  for (int s = 0; s < 2; ++s) {
    auto runtime = StageRuntime::Create(job, {s, 2, Split(2)[s].first, Split(2)[s].second},
                                        RuntimeOptions());
    ASSERT_TRUE(runtime.ok()) << runtime.status();
    runtimes.push_back(*std::move(runtime));
  }
  Inbox first_inbox(64), last_inbox(64);
  InboxSink to_last(&last_inbox, true), to_first(&first_inbox, false);
  StallingSink stalling(&to_last, 6);
  RecordingProgress progress;
  PipelineDriverOptions first_options;
  first_options.stage = 0;
  first_options.num_stages = 2;
  first_options.schedule = schedule;
  first_options.reply_timeout = absl::Milliseconds(300);
  PipelineDriverOptions last_options = first_options;
  last_options.stage = 1;
  absl::Status last_result;
  std::thread last([&] {
    PipelineDriver driver(job, last_options, runtimes[1].get(), &to_first, nullptr, &last_inbox,
                          &progress);
    last_result = driver.Run();
  });
  PipelineDriver first(job, first_options, runtimes[0].get(), nullptr, &stalling, &first_inbox,
                       &progress);
  const absl::Time start = absl::Now();
  const absl::Status ran = first.Run();
  const absl::Duration took = absl::Now() - start;
  last_inbox.Close();
  last.join();
  EXPECT_TRUE(absl::IsUnavailable(ran)) << ran;
  EXPECT_NE(ran.message().find("the downstream link is stalled"), std::string::npos) << ran;
  EXPECT_EQ(first.failed_link(), PipelineDriver::FailedLink::kDownstream);
  EXPECT_LT(took, absl::Seconds(60));
}

TEST(ReplyTimeoutTest, StagesNearerTheEndGiveUpFirst) {
  const absl::Duration base = absl::Seconds(10);
  EXPECT_EQ(ReplyTimeoutFor(base, 3, 4), base);  // the last stage owes nobody
  EXPECT_EQ(ReplyTimeoutFor(base, 2, 4), base);
  EXPECT_EQ(ReplyTimeoutFor(base, 1, 4), 2 * base);
  EXPECT_EQ(ReplyTimeoutFor(base, 0, 4), 3 * base);
}

}  // namespace
}  // namespace geotrain
