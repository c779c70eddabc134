#include "coordinator/audit_manager.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>

#include "tests/coordinator/pipelines_plan.h"

namespace geotrain {
namespace {

std::string Key() { return std::string(32, 'k'); }

std::unique_ptr<AuditManager> Manager(double fraction) {
  auto draw = SpotCheckDraw::Create(Key(), fraction);
  EXPECT_TRUE(draw.ok());
  AuditOptions options;
  options.fraction = fraction;
  options.max_open_audits = 100000;
  return std::make_unique<AuditManager>(*draw, options);
}


const auto kNobodySuspect = [](const std::string&) { return false; };

// About f of every stage's computations are drawn, each with its
// neighbours, its kind, and a verifier from another pipeline of its stage.
TEST(AuditManagerTest, DrawsAboutTheFractionWithAVerifierFromAnotherPipeline) {
  std::unique_ptr<AuditManager> audits = Manager(0.05);
  const v1::Plan plan = PipelinesPlan(3);
  int opened = 0;
  std::set<std::string> audited;
  for (int step = 1; step <= 400; ++step) {
    for (const Audit& a : audits->OnStepCommitted(plan, step, 4, {}, kNobodySuspect)) {
      ++opened;
      audited.insert(a.audited);
      EXPECT_EQ(a.epoch, 4u);
      EXPECT_GE(a.microbatch, static_cast<uint64_t>(step - 1) * 4);
      EXPECT_LT(a.microbatch, static_cast<uint64_t>(step) * 4);
      EXPECT_EQ(a.audited, "p" + std::to_string(a.pipeline) + "s" + std::to_string(a.stage));
      EXPECT_EQ(a.kind, a.stage < 2 ? v1::MESSAGE_KIND_ACTIVATION : v1::MESSAGE_KIND_GRADIENT);
      EXPECT_EQ(a.upstream, a.stage == 0 ? "" : "p" + std::to_string(a.pipeline) + "s" +
                                                    std::to_string(a.stage - 1));
      ASSERT_EQ(a.verifiers.size(), 1u);
      const std::string& v = a.verifiers[0];
      EXPECT_EQ(v.substr(2), "s" + std::to_string(a.stage)) << v;  // the same stage
      EXPECT_NE(v.substr(0, 2), "p" + std::to_string(a.pipeline)) << v;  // another pipeline
    }
  }
  // 400 steps x 4 microbatches x 3 stages x 3 pipelines x 5%: 720.
  EXPECT_NEAR(opened, 720, 4 * 26);
  EXPECT_EQ(audited.size(), 9u);
  EXPECT_EQ(audits->counts().drawn, opened);
}

// Update audits: the update after step s of each stage in each pipeline is
// drawn at f by a draw of its own, with the step's microbatches and the
// next step's first (whose output commits to the updated weights); only
// steps within the plan, none without the option, none of a tied
// embedding's two ends.
TEST(AuditManagerTest, UpdatesAreDrawnPerStageAndStepWithTheStepsMicrobatches) {
  auto draw = SpotCheckDraw::Create(Key(), 0.05);
  ASSERT_TRUE(draw.ok());
  AuditOptions options;
  options.fraction = 0.05;
  options.max_open_audits = 100000;
  options.audit_updates = true;
  AuditManager audits(*draw, options);
  v1::Plan plan = PipelinesPlan(3);
  plan.set_start_step(10);
  int updates = 0, outputs = 0;
  std::set<std::string> audited;
  for (int step = 1; step <= 410; ++step) {
    for (const Audit& a : audits.OnStepCommitted(plan, step, 4, {}, kNobodySuspect)) {
      if (!a.update) {
        ++outputs;
        continue;
      }
      ++updates;
      audited.insert(a.audited);
      EXPECT_EQ(a.step, step - 1);
      EXPECT_GT(a.step, 10);  // the update and the step after it are the plan's
      ASSERT_EQ(a.microbatches.size(), 4u);
      for (int j = 0; j < 4; ++j) {
        EXPECT_EQ(a.microbatches[j], static_cast<uint64_t>(a.step - 1) * 4 + j);
      }
      EXPECT_EQ(a.microbatch, a.microbatches[0]);
      EXPECT_EQ(a.next_microbatch, static_cast<uint64_t>(a.step) * 4);
      EXPECT_EQ(a.kind, a.stage < 2 ? v1::MESSAGE_KIND_ACTIVATION : v1::MESSAGE_KIND_GRADIENT);
      ASSERT_EQ(a.verifiers.size(), 1u);
      EXPECT_EQ(a.verifiers[0].substr(2), "s" + std::to_string(a.stage));
      EXPECT_NE(a.verifiers[0], a.audited);
    }
  }
  // Steps 11-409 x 3 stages x 3 pipelines x 5%: about 180.
  EXPECT_NEAR(updates, 180, 4 * 13.1);
  EXPECT_EQ(audited.size(), 9u);
  EXPECT_GT(outputs, 0);

  options.tied_ends = true;
  AuditManager tied(*draw, options);
  std::set<int> stages;
  for (int step = 1; step <= 200; ++step) {
    for (const Audit& a : tied.OnStepCommitted(plan, step, 4, {}, kNobodySuspect)) {
      if (a.update) stages.insert(a.stage);
    }
  }
  EXPECT_EQ(stages, std::set<int>{1});

  // A stage whose state cannot be uploaded in one call is not drawn.
  options.tied_ends = false;
  options.layer_parameters = {1000, 200000, 1000};
  options.max_update_state_bytes = 1 << 20;  // 16 bytes a parameter: layer 1 is 3.2 MB
  AuditManager sized(*draw, options);
  v1::Plan layered = plan;
  for (int k = 0; k < layered.stages_size(); ++k) {
    layered.mutable_stages(k)->set_layer_begin(k);
    layered.mutable_stages(k)->set_layer_end(k + 1);
  }
  stages.clear();
  for (int step = 1; step <= 200; ++step) {
    for (const Audit& a : sized.OnStepCommitted(layered, step, 4, {}, kNobodySuspect)) {
      if (a.update) stages.insert(a.stage);
    }
  }
  EXPECT_EQ(stages, (std::set<int>{0, 2}));

  std::unique_ptr<AuditManager> without = Manager(0.05);
  for (int step = 1; step <= 200; ++step) {
    for (const Audit& a : without->OnStepCommitted(plan, step, 4, {}, kNobodySuspect)) {
      EXPECT_FALSE(a.update);
    }
  }
}

// A suspect is audited about `suspect_boost` times as often.
TEST(AuditManagerTest, ASuspectIsAuditedMoreOften) {
  std::unique_ptr<AuditManager> audits = Manager(0.01);
  const v1::Plan plan = PipelinesPlan(3);
  std::map<std::string, int> per_worker;
  for (int step = 1; step <= 500; ++step) {
    for (const Audit& a : audits->OnStepCommitted(
             plan, step, 4, {}, [](const std::string& id) { return id == "p1s1"; })) {
      ++per_worker[a.audited];
    }
  }
  // 2,000 computations each: about 20 audits, and about 200 for the suspect.
  EXPECT_NEAR(per_worker["p1s1"], 200, 4 * 13.4);
  EXPECT_NEAR(per_worker["p0s1"], 20, 4 * 4.5);
}

std::unique_ptr<AuditManager> WithOneAudit(const v1::Plan& plan, Audit* audit) {
  std::unique_ptr<AuditManager> audits = Manager(1.0);
  for (const Audit& a : audits->OnStepCommitted(plan, 1, 1, {}, kNobodySuspect)) {
    if (a.audited == "p0s1") *audit = a;
  }
  return audits;
}

TEST(AuditManagerTest, APassingVerdictClosesTheAudit) {
  const v1::Plan plan = PipelinesPlan(3);
  Audit audit;
  std::unique_ptr<AuditManager> audits = WithOneAudit(plan, &audit);
  ASSERT_EQ(audit.audited, "p0s1");
  auto decision = audits->OnVerdict(audit.id, audit.verifiers[0], true, true, "ok", plan, {});
  ASSERT_TRUE(decision.ok()) << decision.status();
  EXPECT_EQ(decision->audit.state, Audit::State::kPassed);
  EXPECT_TRUE(decision->evict.empty());
  EXPECT_FALSE(decision->ask.has_value());
  EXPECT_EQ(audits->PerWorker()["p0s1"].first, 1);
  // Answered once: a second answer finds no open audit.
  EXPECT_EQ(audits->OnVerdict(audit.id, audit.verifiers[0], false, true, "", plan, {})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

// Two verifiers find the mismatch: the audited worker is to be evicted.
TEST(AuditManagerTest, TwoFailingVerdictsConfirmTheMismatch) {
  const v1::Plan plan = PipelinesPlan(3);
  Audit audit;
  std::unique_ptr<AuditManager> audits = WithOneAudit(plan, &audit);
  auto first = audits->OnVerdict(audit.id, audit.verifiers[0], false, true, "FAILED: 1728 of 2112",
                                plan, {});
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(first->ask.has_value());  // a second verifier, another one
  EXPECT_NE(*first->ask, audit.verifiers[0]);
  EXPECT_TRUE(first->evict.empty());  // never on one verifier's word
  auto second = audits->OnVerdict(audit.id, *first->ask, false, true, "FAILED: 1730 of 2112",
                                 plan, {});
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->audit.state, Audit::State::kConfirmed);
  EXPECT_EQ(second->evict, std::vector<std::string>{"p0s1"});
  EXPECT_NE(second->reason.find("failed 2 verifiers"), std::string::npos) << second->reason;
  EXPECT_EQ(audits->counts().confirmed, 1);
}

// A forged accusation: the first verifier fails an honest computation, the
// second passes it, the third passes it. The liar is the one evicted.
TEST(AuditManagerTest, AVerifierThatLiesIsOutvotedAndEvicted) {
  const v1::Plan plan = PipelinesPlan(4);  // three verifiers to ask
  Audit audit;
  std::unique_ptr<AuditManager> audits = WithOneAudit(plan, &audit);
  const std::string liar = audit.verifiers[0];
  auto first = audits->OnVerdict(audit.id, liar, false, true, "FAILED (forged)", plan, {});
  ASSERT_TRUE(first.ok() && first->ask.has_value());
  auto second = audits->OnVerdict(audit.id, *first->ask, true, true, "passed", plan, {});
  ASSERT_TRUE(second.ok() && second->ask.has_value()) << "a tie: a third verifier decides";
  EXPECT_TRUE(second->evict.empty());
  auto third = audits->OnVerdict(audit.id, *second->ask, true, true, "passed", plan, {});
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->audit.state, Audit::State::kVerifierLied);
  EXPECT_EQ(third->evict, std::vector<std::string>{liar});
  EXPECT_EQ(audits->counts().verifiers_caught, 1);
  EXPECT_EQ(audits->PerWorker()["p0s1"].second, 0);  // the honest worker has no failure
}

// With no one left to settle a disagreement, nobody is evicted.
TEST(AuditManagerTest, ADisagreementWithNoOneLeftEvictsNobody) {
  const v1::Plan plan = PipelinesPlan(3);  // two other pipelines: two verifiers
  Audit audit;
  std::unique_ptr<AuditManager> audits = WithOneAudit(plan, &audit);
  auto first = audits->OnVerdict(audit.id, audit.verifiers[0], false, true, "FAILED", plan, {});
  ASSERT_TRUE(first.ok() && first->ask.has_value());
  auto second = audits->OnVerdict(audit.id, *first->ask, true, true, "passed", plan, {});
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->audit.state, Audit::State::kUndecided);
  EXPECT_TRUE(second->evict.empty());
}

// Standbys verify where no other pipeline has the stage; the audited
// worker's neighbours never do.
TEST(AuditManagerTest, StandbysVerifyOnePipeline) {
  std::unique_ptr<AuditManager> audits = Manager(1.0);
  const v1::Plan plan = PipelinesPlan(1);
  auto opened = audits->OnStepCommitted(plan, 1, 1, {"p0s0", "standby"}, kNobodySuspect);
  ASSERT_EQ(opened.size(), 3u);
  for (const Audit& a : opened) {
    ASSERT_EQ(a.verifiers.size(), 1u);
    EXPECT_NE(a.verifiers[0], a.audited);
    EXPECT_NE(a.verifiers[0], a.upstream);
    EXPECT_NE(a.verifiers[0], a.downstream);
  }
  // Without standbys there is no verifier: undecided at once, none opened.
  std::unique_ptr<AuditManager> alone = Manager(1.0);
  EXPECT_TRUE(alone->OnStepCommitted(plan, 1, 1, {}, kNobodySuspect).empty());
  EXPECT_EQ(alone->counts().undecided, 3);
}

// Only the verifier asked answers; unverifiable claims evict nobody. A
// second verifier is asked first: two that agree close it so.
TEST(AuditManagerTest, OnlyTheVerifierAskedAnswers) {
  const v1::Plan plan = PipelinesPlan(3);
  Audit audit;
  std::unique_ptr<AuditManager> audits = WithOneAudit(plan, &audit);
  EXPECT_EQ(audits->OnVerdict(audit.id, "p0s1", true, true, "", plan, {}).status().code(),
            absl::StatusCode::kPermissionDenied);
  auto first = audits->OnVerdict(audit.id, audit.verifiers[0], false, false,
                                 "unverifiable: topk", plan, {});
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(first->ask.has_value());
  EXPECT_TRUE(first->evict.empty());
  auto second = audits->OnVerdict(audit.id, *first->ask, false, false, "unverifiable: topk",
                                  plan, {});
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->audit.state, Audit::State::kUnverifiable);
  EXPECT_TRUE(second->evict.empty());
  EXPECT_EQ(audits->counts().unverifiable, 1);

  // With no second verifier, one unverifiable verdict closes it.
  const v1::Plan two = PipelinesPlan(2);
  std::unique_ptr<AuditManager> alone = WithOneAudit(two, &audit);
  auto only = alone->OnVerdict(audit.id, audit.verifiers[0], false, false, "unverifiable: topk",
                               two, {});
  ASSERT_TRUE(only.ok());
  EXPECT_EQ(only->audit.state, Audit::State::kUnverifiable);
  EXPECT_TRUE(only->evict.empty());
}

// Whether a bundle can be recomputed follows from its evidence, so honest
// verifiers agree on it. A verifier that calls a colluder's computation
// unverifiable to shield it is outvoted by two verdicts and evicted, and
// the verdicts go on: here they confirm the mismatch. One that gives a
// verdict on what two others find unverifiable is evicted the same way.
TEST(AuditManagerTest, AVerifierOutvotedOnWhetherItCanBeRecomputedIsEvicted) {
  const v1::Plan plan = PipelinesPlan(4);  // three verifiers to ask
  Audit audit;
  std::unique_ptr<AuditManager> audits = WithOneAudit(plan, &audit);
  const std::string shield = audit.verifiers[0];
  auto first = audits->OnVerdict(audit.id, shield, false, false, "unverifiable (forged)", plan,
                                 {});
  ASSERT_TRUE(first.ok() && first->ask.has_value());
  auto second = audits->OnVerdict(audit.id, *first->ask, false, true, "FAILED", plan, {});
  ASSERT_TRUE(second.ok() && second->ask.has_value()) << "one each: a third decides";
  EXPECT_TRUE(second->evict.empty());
  auto third = audits->OnVerdict(audit.id, *second->ask, false, true, "FAILED", plan, {});
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->audit.state, Audit::State::kConfirmed);
  EXPECT_EQ(third->evict, (std::vector<std::string>{shield, "p0s1"}));

  // The other way round: two find it unverifiable, one passed it.
  std::unique_ptr<AuditManager> again = WithOneAudit(plan, &audit);
  const std::string liar = audit.verifiers[0];
  first = again->OnVerdict(audit.id, liar, true, true, "passed (forged)", plan, {});
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->audit.state, Audit::State::kPassed) << "a first verdict that passes is final";

  std::unique_ptr<AuditManager> third_way = WithOneAudit(plan, &audit);
  first = third_way->OnVerdict(audit.id, audit.verifiers[0], false, false, "unverifiable", plan,
                               {});
  ASSERT_TRUE(first.ok() && first->ask.has_value());
  const std::string gave_verdict = *first->ask;
  second = third_way->OnVerdict(audit.id, gave_verdict, false, true, "FAILED (forged)", plan, {});
  ASSERT_TRUE(second.ok() && second->ask.has_value());
  third = third_way->OnVerdict(audit.id, *second->ask, false, false, "unverifiable", plan, {});
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->audit.state, Audit::State::kVerifierLied);
  EXPECT_EQ(third->evict, std::vector<std::string>{gave_verdict});
  EXPECT_EQ(third_way->PerWorker()["p0s1"].second, 0);
}

// An honest stage's update audits are unverifiable about once per outer
// step; a worker that claims a sync at every update it skips is
// unverifiable every time, and the rule tells them apart.
TEST(AuditManagerTest, UnverifiableUpdatesAreHeldToTheJobsSyncRate) {
  v1::JobSpec job;
  EXPECT_DOUBLE_EQ(UpdateSyncRate(job), 0.05) << "no syncs: the floor for re-plans";
  job.mutable_outer()->set_inner_steps(8);
  EXPECT_DOUBLE_EQ(UpdateSyncRate(job), 1.5 / 8);
  job.set_replicas(2);
  job.set_replica_sync_every(5);
  EXPECT_DOUBLE_EQ(UpdateSyncRate(job), 1.5 * (1.0 / 8 + 1.0 / 5));

  const double rate = 1.5 / 8;
  EXPECT_FALSE(UnverifiableUpdatesUnexplained(7, 7, rate)) << "too few to tell";
  EXPECT_TRUE(UnverifiableUpdatesUnexplained(12, 12, rate));
  EXPECT_FALSE(UnverifiableUpdatesUnexplained(12, 2, rate));
  // An honest stage (one sync in 8 steps) over 10,000 runs of 200 audits:
  // never over the rule.
  std::mt19937_64 random(5);
  std::bernoulli_distribution sync(1.0 / 8);
  int flagged = 0;
  for (int run = 0; run < 10000; ++run) {
    int64_t unverifiable = 0;
    for (int64_t n = 1; n <= 200; ++n) {
      unverifiable += sync(random) ? 1 : 0;
      if (UnverifiableUpdatesUnexplained(n, unverifiable, rate)) {
        ++flagged;
        break;
      }
    }
  }
  EXPECT_EQ(flagged, 0);
  // One that dodges half its updates (about 56% of its audits
  // unverifiable) is found within 60 of them.
  EXPECT_TRUE(UnverifiableUpdatesUnexplained(60, 34, rate));
}

}  // namespace
}  // namespace geotrain
