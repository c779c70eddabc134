#include "coordinator/audit_coordinator.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tests/coordinator/pipelines_plan.h"

namespace geotrain {
namespace {

// Three pipelines of two stages: only stage 1 (the last) is audited, on its
// gradient; its input comes from stage 0, which also receives the claim.
class AuditCoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(1.0); }

  void Make(double fraction, uint64_t max_evidence_bytes = uint64_t{1} << 30,
            bool audit_updates = false) {
    EventLogOptions events;
    events.clock = &clock_;
    events.keep = 10000;
    events_ = std::make_unique<EventLog>(std::move(events));
    auto draw = SpotCheckDraw::Create(std::string(32, 'k'), fraction);
    ASSERT_TRUE(draw.ok());
    AuditCoordinatorOptions options;
    options.audits.fraction = fraction;
    options.audits.first_audited_stage = 1;
    options.audits.max_open_audits = 1000;
    options.clock = &clock_;
    options.events = events_.get();
    options.evict = [this](const std::string& worker, const std::string& why,
                           std::optional<int> trusted_step) {
      evicted_.push_back(worker);
      trusted_at_eviction_[worker] = trusted_step;
    };
    options.max_evidence_bytes = max_evidence_bytes;
    options.audits.audit_updates = audit_updates;
    options.total_steps = 100;
    audits_ = std::make_unique<AuditCoordinator>(*draw, options);
  }

  // The work a worker is handed in its next heartbeat reply.
  v1::HeartbeatResponse Work(const std::string& worker) {
    v1::HeartbeatResponse response;
    audits_->FillHeartbeat(worker, &response);
    return response;
  }

  static v1::LoggedLinkMessage Message(v1::MessageKind kind, uint64_t microbatch,
                                       const std::string& commitment) {
    v1::LoggedLinkMessage m;
    m.mutable_header()->set_kind(kind);
    m.mutable_header()->set_microbatch(microbatch);
    m.mutable_header()->set_commitment(commitment);
    m.set_payload("bytes");
    return m;
  }

  // Each owed part as an honest worker gives it: the input committed as
  // "in", the claim as "out", both received as sent (unless told).
  v1::AuditEvidence Part(const std::string& worker, const v1::EvidenceRequest& request,
                         const std::string& received_input = "in",
                         const std::string& received_claim = "out") {
    v1::AuditEvidence e;
    e.set_worker_id(worker);
    e.set_audit_id(request.audit_id());
    e.set_part(request.part());
    e.set_found(true);
    switch (request.part()) {
      case v1::EvidenceRequest::SENT_INPUT:
        *e.mutable_message() =
            Message(v1::MESSAGE_KIND_ACTIVATION, request.microbatch(), "in");
        break;
      case v1::EvidenceRequest::CLAIM:
        *e.mutable_message() = Message(v1::MESSAGE_KIND_GRADIENT, request.microbatch(), "out");
        e.add_weights()->set_layer(1);
        e.set_weights_digest("digest");
        e.set_received_commitment(received_input);
        break;
      default:
        e.set_received_commitment(received_claim);
    }
    return e;
  }

  // Gives every owed part of every audit of `pipelines` pipelines; returns
  // the audits by verifier. (A heartbeat reply hands out both kinds of
  // work: every request is taken before any part is given.)
  std::map<std::string, std::vector<uint64_t>> GiveAllEvidence(
      const std::string& received_claim = "out", int pipelines = 3) {
    std::map<std::string, v1::HeartbeatResponse> work;
    for (int r = 0; r < pipelines; ++r) {
      for (int k = 0; k < 2; ++k) work[PipelineWorker(r, k)] = Work(PipelineWorker(r, k));
    }
    for (const auto& [w, response] : work) {
      for (const v1::EvidenceRequest& request : response.evidence_requests()) {
        EXPECT_TRUE(audits_->AcceptEvidence(w, Part(w, request, "in", received_claim)).ok());
      }
    }
    std::map<std::string, std::vector<uint64_t>> asked;
    for (const auto& [w, unused] : work) {
      const v1::HeartbeatResponse response = Work(w);
      for (uint64_t id : response.verify_audits()) asked[w].push_back(id);
    }
    return asked;
  }

  v1::AuditVerdict Verdict(const std::string& verifier, uint64_t id, bool passed) {
    v1::AuditVerdict v;
    v.set_worker_id(verifier);
    v.set_audit_id(id);
    v.set_ran(true);
    v.set_verifiable(true);
    v.set_passed(passed);
    v.set_summary(passed ? "0 of 10 outside" : "9 of 10 outside");
    return v;
  }

  int EventsOf(const std::string& kind) {
    int n = 0;
    for (const v1::Event& e : events_->Recent()) n += e.kind() == kind ? 1 : 0;
    return n;
  }

  const v1::Plan plan_ = PipelinesPlan(3, 2);
  FakeClock clock_{1000};
  std::unique_ptr<EventLog> events_;
  std::unique_ptr<AuditCoordinator> audits_;
  std::vector<std::string> evicted_;
  std::map<std::string, std::optional<int>> trusted_at_eviction_;
};

// With f = 1 every microbatch of stage 1 in every pipeline is audited: its
// upstream owes the input and the receipt, it owes the claim, and once all
// are in a stage-1 worker of another pipeline is asked to verify.
TEST_F(AuditCoordinatorTest, EvidenceIsAskedOfItsHoldersAndGoesToTheVerifier) {
  audits_->OnCommitted(plan_, 1, 2, {});
  EXPECT_EQ(audits_->Figures().open, 6);  // 3 pipelines x 2 microbatches
  std::map<int, std::pair<v1::HeartbeatResponse, v1::HeartbeatResponse>> work;
  for (int r = 0; r < 3; ++r) {
    work[r] = {Work(PipelineWorker(r, 0)), Work(PipelineWorker(r, 1))};
    // Handed out once.
    EXPECT_EQ(Work(PipelineWorker(r, 1)).evidence_requests_size(), 0);
  }
  for (int r = 0; r < 3; ++r) {
    const v1::HeartbeatResponse& upstream = work[r].first;
    const v1::HeartbeatResponse& audited = work[r].second;
    ASSERT_EQ(upstream.evidence_requests_size(), 4);  // input and receipt, twice
    ASSERT_EQ(audited.evidence_requests_size(), 2);
    for (const v1::EvidenceRequest& q : audited.evidence_requests()) {
      EXPECT_EQ(q.part(), v1::EvidenceRequest::CLAIM);
      EXPECT_TRUE(q.gradient());
      EXPECT_LT(q.microbatch(), 2u);
    }
    for (const v1::EvidenceRequest& q : upstream.evidence_requests()) {
      const std::string w = PipelineWorker(r, 0);
      ASSERT_TRUE(audits_->AcceptEvidence(w, Part(w, q)).ok());
    }
    for (const v1::EvidenceRequest& q : audited.evidence_requests()) {
      const std::string w = PipelineWorker(r, 1);
      // Nobody else may give its part.
      EXPECT_EQ(audits_->AcceptEvidence(PipelineWorker(r, 0), Part(PipelineWorker(r, 0), q))
                    .code(),
                absl::StatusCode::kPermissionDenied);
      ASSERT_TRUE(audits_->AcceptEvidence(w, Part(w, q)).ok());
      // Nor give it twice.
      EXPECT_EQ(audits_->AcceptEvidence(w, Part(w, q)).code(),
                absl::StatusCode::kPermissionDenied);
    }
  }
  int tasks = 0;
  for (int r = 0; r < 3; ++r) {
    const std::string verifier = PipelineWorker(r, 1);
    const v1::HeartbeatResponse work_of_verify_audits = Work(verifier);
    for (uint64_t id : work_of_verify_audits.verify_audits()) {
      ++tasks;
      // Only the verifier asked may fetch it.
      EXPECT_EQ(audits_->Fetch(PipelineWorker(r, 0), id).status().code(),
                absl::StatusCode::kPermissionDenied);
      absl::StatusOr<v1::AuditBundle> bundle = audits_->Fetch(verifier, id);
      ASSERT_TRUE(bundle.ok()) << bundle.status();
      EXPECT_EQ(bundle->stage(), 1);
      EXPECT_EQ(bundle->num_stages(), 2);
      EXPECT_EQ(bundle->input().header().commitment(), "in");
      EXPECT_EQ(bundle->claim().header().commitment(), "out");
      EXPECT_EQ(bundle->weights_digest(), "digest");
      EXPECT_NE(bundle->claim().header().microbatch(), 99u);
      ASSERT_TRUE(audits_->AcceptVerdict(verifier, Verdict(verifier, id, true), plan_, {}).ok());
      // A verifier answers once.
      EXPECT_FALSE(audits_->AcceptVerdict(verifier, Verdict(verifier, id, true), plan_, {}).ok());
    }
  }
  EXPECT_EQ(tasks, 6);
  const AuditFigures figures = audits_->Figures();
  EXPECT_EQ(figures.counts.passed, 6);
  EXPECT_EQ(figures.open, 0);
  EXPECT_EQ(figures.evidence_bytes, 0u);
  EXPECT_TRUE(evicted_.empty());
  EXPECT_EQ(audits_->PerWorker().at(PipelineWorker(1, 1)).first, 2);
}

// Two verifiers fail the audited worker: it is evicted, once, though
// several of its audits were open; one verifier's word evicts nobody.
TEST_F(AuditCoordinatorTest, TwoFailedVerdictsEvictTheAuditedWorkerOnce) {
  audits_->OnCommitted(plan_, 1, 2, {});
  // Every first verdict fails.
  for (const auto& [verifier, ids] : GiveAllEvidence()) {
    for (uint64_t id : ids) {
      ASSERT_TRUE(audits_->AcceptVerdict(verifier, Verdict(verifier, id, false), plan_, {}).ok());
    }
  }
  EXPECT_TRUE(evicted_.empty());
  EXPECT_EQ(EventsOf("audit_failed"), 6);
  // And every second: the audited workers are evicted, each once (two
  // audits of each were open).
  int second = 0;
  for (int r = 0; r < 3; ++r) {
    const std::string w = PipelineWorker(r, 1);
    const v1::HeartbeatResponse work_of_verify_audits = Work(w);
    for (uint64_t id : work_of_verify_audits.verify_audits()) {
      ++second;
      const absl::Status s = audits_->AcceptVerdict(w, Verdict(w, id, false), plan_, {});
      // An evicted worker's other audits are closed with it: no verdict
      // is asked for them any more.
      EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kPermissionDenied) << s;
    }
  }
  EXPECT_EQ(second, 6);
  // The first worker evicted takes with it the audits waiting on its
  // verdict (undecided), so two or three are evicted, never one twice.
  std::map<std::string, int> times;
  for (const std::string& w : evicted_) ++times[w];
  EXPECT_GE(times.size(), 2u);
  for (const auto& [w, n] : times) EXPECT_EQ(n, 1) << w;
  EXPECT_EQ(EventsOf("audit_evicted"), static_cast<int>(evicted_.size()));
  EXPECT_EQ(audits_->Figures().open, 0);
  // Wrong from the start: trusted only to where the plan started.
  for (const auto& [w, n] : times) EXPECT_EQ(trusted_at_eviction_[w], 0) << w;
}

// Issue 35's rollback: a worker is trusted up to its newest passed audit;
// caught later, its eviction carries that step for the job to go back to.
// The floor (what the checkpoint store keeps) is the least trusted
// worker's: here stage 0's, never audited, at the plan's start.
TEST_F(AuditCoordinatorTest, AWorkerCaughtIsEvictedWithTheStepItWasTrustedUpTo) {
  EXPECT_EQ(audits_->TrustedFloor(), -1);
  audits_->OnCommitted(plan_, 3, 1, {});
  for (const auto& [verifier, ids] : GiveAllEvidence()) {
    for (uint64_t id : ids) {
      ASSERT_TRUE(audits_->AcceptVerdict(verifier, Verdict(verifier, id, true), plan_, {}).ok());
    }
  }
  EXPECT_EQ(audits_->Figures().open, 0);
  EXPECT_EQ(audits_->TrustedFloor(), 0);
  // Step 4's audits fail twice each.
  audits_->OnCommitted(plan_, 4, 1, {});
  for (const auto& [verifier, ids] : GiveAllEvidence()) {
    for (uint64_t id : ids) {
      ASSERT_TRUE(audits_->AcceptVerdict(verifier, Verdict(verifier, id, false), plan_, {}).ok());
    }
  }
  for (int r = 0; r < 3; ++r) {
    const std::string w = PipelineWorker(r, 1);
    // Held: a range-for over a temporary's member would read freed memory.
    const v1::HeartbeatResponse work = Work(w);
    for (uint64_t id : work.verify_audits()) {
      const absl::Status s = audits_->AcceptVerdict(w, Verdict(w, id, false), plan_, {});
      EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kPermissionDenied) << s;
    }
  }
  ASSERT_FALSE(evicted_.empty());
  for (const std::string& w : evicted_) EXPECT_EQ(trusted_at_eviction_[w], 3) << w;
}

// A verifier that fails an honest computation is outvoted by the next two
// and evicted itself; the audited worker stays (four pipelines: three
// verifiers besides the audited stage).
TEST_F(AuditCoordinatorTest, AForgedAccusationEvictsTheAccuserNotTheAccused) {
  const v1::Plan plan = PipelinesPlan(4, 2);
  audits_->OnCommitted(plan, 1, 1, {});
  // The first verifier of one audit lies; the others are honest.
  uint64_t target = 0;
  std::string liar;
  std::map<uint64_t, std::string> first;
  for (const auto& [w, ids] : GiveAllEvidence("out", /*pipelines=*/4)) {
    for (uint64_t id : ids) first[id] = w;
  }
  ASSERT_EQ(first.size(), 4u);
  for (const auto& [id, verifier] : first) {
    absl::StatusOr<v1::AuditBundle> bundle = audits_->Fetch(verifier, id);
    ASSERT_TRUE(bundle.ok());
    const bool lie = target == 0;
    if (lie) {
      target = id;
      liar = verifier;
    }
    ASSERT_TRUE(audits_->AcceptVerdict(verifier, Verdict(verifier, id, !lie), plan, {}).ok());
  }
  for (int n = 0; n < 2; ++n) {
    std::string next;
    for (int r = 0; r < 4; ++r) {
      const std::string w = PipelineWorker(r, 1);
      const v1::HeartbeatResponse work_of_verify_audits = Work(w);
      for (uint64_t id : work_of_verify_audits.verify_audits()) {
        ASSERT_EQ(id, target);
        next = w;
      }
    }
    ASSERT_FALSE(next.empty()) << "verifier " << n + 2 << " was not asked";
    ASSERT_NE(next, liar);
    ASSERT_TRUE(audits_->AcceptVerdict(next, Verdict(next, target, true), plan, {}).ok());
  }
  ASSERT_EQ(evicted_, std::vector<std::string>{liar});
  // A lying verifier computed nothing the job used: no rollback.
  EXPECT_EQ(trusted_at_eviction_[liar], std::nullopt);
  EXPECT_EQ(audits_->Figures().counts.verifiers_caught, 1);
  EXPECT_EQ(audits_->Figures().counts.confirmed, 0);
}

// The logs disagree about what went over a link: a dispute that no
// commitment settles; both are audited as suspects, nobody is evicted.
TEST_F(AuditCoordinatorTest, LogsThatDisagreeAreADisputeNotAnEviction) {
  audits_->OnCommitted(plan_, 1, 2, {});
  GiveAllEvidence(/*received_claim=*/"something else");
  const AuditFigures figures = audits_->Figures();
  EXPECT_EQ(figures.disputes, 6);
  EXPECT_EQ(figures.open, 0);
  EXPECT_EQ(figures.counts.undecided, 6);
  EXPECT_TRUE(evicted_.empty());
  EXPECT_EQ(EventsOf("audit_disputed"), 6);
  EXPECT_TRUE(audits_->Disputed(PipelineWorker(0, 0)));
  EXPECT_TRUE(audits_->Disputed(PipelineWorker(0, 1)));
}

// Evidence that is no longer held, or never uploaded, closes the audit
// undecided with an event naming who did not answer.
TEST_F(AuditCoordinatorTest, MissingEvidenceClosesTheAuditUndecided) {
  audits_->OnCommitted(plan_, 1, 2, {});
  const std::string audited = PipelineWorker(0, 1);
  const v1::HeartbeatResponse work = Work(audited);
  ASSERT_EQ(work.evidence_requests_size(), 2);
  v1::AuditEvidence gone;
  gone.set_worker_id(audited);
  gone.set_audit_id(work.evidence_requests(0).audit_id());
  gone.set_part(v1::EvidenceRequest::CLAIM);
  gone.set_found(false);
  gone.set_detail("weight version 3 is no longer kept");
  ASSERT_TRUE(audits_->AcceptEvidence(audited, gone).ok());
  EXPECT_EQ(EventsOf("audit_evidence_missing"), 1);
  EXPECT_EQ(audits_->Figures().open, 5);
  // The rest never come, and the work nobody took goes with them.
  clock_.AdvanceMs(31000);
  audits_->Expire();
  EXPECT_EQ(audits_->Figures().open, 0);
  EXPECT_EQ(Work(PipelineWorker(1, 0)).evidence_requests_size(), 0);
  EXPECT_EQ(audits_->Figures().expired, 5);
  EXPECT_EQ(EventsOf("audit_expired"), 5);
  EXPECT_TRUE(evicted_.empty());
}

// Evidence past the coordinator's bound is refused and its audit closed.
TEST_F(AuditCoordinatorTest, EvidenceIsBounded) {
  Make(1.0, /*max_evidence_bytes=*/64);
  audits_->OnCommitted(plan_, 1, 2, {});
  const std::string w = PipelineWorker(0, 1);
  const v1::HeartbeatResponse work = Work(w);
  ASSERT_GT(work.evidence_requests_size(), 0);
  v1::AuditEvidence big = Part(w, work.evidence_requests(0));
  big.mutable_message()->set_payload(std::string(1000, 'x'));
  EXPECT_EQ(audits_->AcceptEvidence(w, big).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(audits_->Figures().evidence_bytes, 0u);
  EXPECT_EQ(audits_->Figures().open, 5);
}

// Evidence of another microbatch than asked is refused.
TEST_F(AuditCoordinatorTest, EvidenceOfAnotherMessageIsRefused) {
  audits_->OnCommitted(plan_, 1, 2, {});
  const std::string w = PipelineWorker(0, 1);
  const v1::HeartbeatResponse work = Work(w);
  v1::AuditEvidence other = Part(w, work.evidence_requests(0));
  other.mutable_message()->mutable_header()->set_microbatch(77);
  EXPECT_EQ(audits_->AcceptEvidence(w, other).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EventsOf("audit_evidence_refused"), 1);
}

// Stage 0's input is data: its audits owe no input, and the verifier's
// bundle carries the plan it derives the audited worker's data from.
TEST_F(AuditCoordinatorTest, StageZeroAuditsCarryThePlanInsteadOfAnInput) {
  EventLogOptions events;
  events.clock = &clock_;
  events_ = std::make_unique<EventLog>(std::move(events));
  auto draw = SpotCheckDraw::Create(std::string(32, 'k'), 1.0);
  ASSERT_TRUE(draw.ok());
  AuditCoordinatorOptions options;
  options.audits.fraction = 1.0;
  options.audits.max_open_audits = 1000;
  options.clock = &clock_;
  options.events = events_.get();
  options.evict = [this](const std::string& worker, const std::string&, std::optional<int>) {
    evicted_.push_back(worker);
  };
  audits_ = std::make_unique<AuditCoordinator>(*draw, options);
  audits_->OnCommitted(plan_, 1, 1, {});
  EXPECT_EQ(audits_->Figures().open, 6);  // both stages of 3 pipelines, 1 microbatch
  // Stage 0 of pipeline 0 owes its claim (its activation), stage 1 the
  // receipt of it, and no one an input.
  std::map<std::string, v1::HeartbeatResponse> work;
  for (int r = 0; r < 3; ++r) {
    for (int k = 0; k < 2; ++k) work[PipelineWorker(r, k)] = Work(PipelineWorker(r, k));
  }
  uint64_t stage_zero = 0;
  for (const auto& [w, response] : work) {
    for (const v1::EvidenceRequest& q : response.evidence_requests()) {
      if (q.stage() != 0) continue;
      EXPECT_NE(q.part(), v1::EvidenceRequest::SENT_INPUT);
      EXPECT_FALSE(q.gradient());
      v1::AuditEvidence e;
      e.set_worker_id(w);
      e.set_audit_id(q.audit_id());
      e.set_part(q.part());
      e.set_found(true);
      if (q.part() == v1::EvidenceRequest::CLAIM) {
        EXPECT_EQ(w.substr(2), "s0");
        *e.mutable_message() = Message(v1::MESSAGE_KIND_ACTIVATION, q.microbatch(), "act");
        stage_zero = q.audit_id();
      } else {
        EXPECT_EQ(w.substr(2), "s1");
        e.set_received_commitment("act");
      }
      ASSERT_TRUE(audits_->AcceptEvidence(w, e).ok());
    }
  }
  ASSERT_NE(stage_zero, 0u);
  bool fetched = false;
  for (int r = 0; r < 3; ++r) {
    const std::string verifier = PipelineWorker(r, 0);
    const v1::HeartbeatResponse response = Work(verifier);
    for (uint64_t id : response.verify_audits()) {
      absl::StatusOr<v1::AuditBundle> bundle = audits_->Fetch(verifier, id);
      ASSERT_TRUE(bundle.ok()) << bundle.status();
      EXPECT_EQ(bundle->stage(), 0);
      EXPECT_FALSE(bundle->has_input());
      EXPECT_EQ(bundle->plan().epoch(), plan_.epoch());
      EXPECT_EQ(bundle->audited_worker().substr(2), "s0");
      EXPECT_NE(bundle->audited_worker(), verifier);
      fetched = true;
    }
  }
  EXPECT_TRUE(fetched);
}

// An update audit of stage 1 (the last; two microbatches a step): its
// upstream owes every microbatch's input and the receipts of its two
// outputs, it owes the outputs of the step and of the next one with the
// weights before and after; the verifier's bundle holds them all, with the
// update's learning-rate position from the coordinator. A received input
// that is not what upstream logged sending is a dispute, not an eviction.
TEST_F(AuditCoordinatorTest, AnUpdateAuditGathersTheWholeStep) {
  for (const bool honest : {true, false}) {
    Make(1.0, uint64_t{1} << 30, /*audit_updates=*/true);
    audits_->OnCommitted(plan_, 2, 2, {});  // draws step 2's outputs and step 1's update
    std::map<std::string, v1::HeartbeatResponse> work;
    for (int r = 0; r < 3; ++r) {
      for (int k = 0; k < 2; ++k) work[PipelineWorker(r, k)] = Work(PipelineWorker(r, k));
    }
    int updates = 0;
    for (const auto& [w, response] : work) {
      for (const v1::EvidenceRequest& q : response.evidence_requests()) {
        if (!q.update()) continue;
        ++updates;
        EXPECT_EQ(q.stage(), 1);
        EXPECT_TRUE(q.gradient());
        ASSERT_EQ(q.microbatches_size(), 2);
        EXPECT_EQ(q.microbatches(0), 0u);
        EXPECT_EQ(q.microbatches(1), 1u);
        EXPECT_EQ(q.next_microbatch(), 2u);
        v1::AuditEvidence e;
        e.set_worker_id(w);
        e.set_audit_id(q.audit_id());
        e.set_part(q.part());
        e.set_found(true);
        switch (q.part()) {
          case v1::EvidenceRequest::SENT_INPUT:
            EXPECT_EQ(w.substr(2), "s0");
            for (uint64_t m : q.microbatches()) {
              *e.add_messages() = Message(v1::MESSAGE_KIND_ACTIVATION, m, "in" + std::to_string(m));
            }
            break;
          case v1::EvidenceRequest::CLAIM:
            EXPECT_EQ(w.substr(2), "s1");
            *e.mutable_message() = Message(v1::MESSAGE_KIND_GRADIENT, 0, "out0");
            *e.mutable_next_message() = Message(v1::MESSAGE_KIND_GRADIENT, 2, "out2");
            e.add_weights()->set_layer(1);
            e.add_weights_after()->set_layer(1);
            e.add_received_commitments("in0");
            e.add_received_commitments(honest || w != "p1s1" ? "in1" : "forged");
            break;
          case v1::EvidenceRequest::RECEIPT:
            EXPECT_EQ(w.substr(2), "s0");
            e.set_received_commitment("out0");
            e.set_next_received_commitment("out2");
            break;
          default:
            ADD_FAILURE() << "stage 1 is the last: no downstream gradients to owe";
        }
        ASSERT_TRUE(audits_->AcceptEvidence(w, e).ok());
      }
    }
    EXPECT_EQ(updates, 3 * 3);  // three parts of one update audit in each pipeline
    int bundles = 0;
    for (int r = 0; r < 3; ++r) {
      const std::string verifier = PipelineWorker(r, 1);
      const v1::HeartbeatResponse response = Work(verifier);
      for (uint64_t id : response.verify_audits()) {
        absl::StatusOr<v1::AuditBundle> bundle = audits_->Fetch(verifier, id);
        ASSERT_TRUE(bundle.ok()) << bundle.status();
        if (!bundle->update()) continue;
        ++bundles;
        EXPECT_EQ(bundle->step(), 1);
        EXPECT_EQ(bundle->microbatches_size(), 2);
        ASSERT_EQ(bundle->inputs_size(), 2);
        EXPECT_EQ(bundle->inputs(1).header().commitment(), "in1");
        EXPECT_EQ(bundle->output_gradients_size(), 0);
        EXPECT_EQ(bundle->claim().header().microbatch(), 0u);
        EXPECT_EQ(bundle->next_claim().header().microbatch(), 2u);
        EXPECT_EQ(bundle->weights_size(), 1);
        EXPECT_EQ(bundle->weights_after_size(), 1);
        EXPECT_DOUBLE_EQ(bundle->progress(), 0.01);  // step 1 of 100
      }
    }
    EXPECT_EQ(bundles, honest ? 3 : 2);
    EXPECT_EQ(EventsOf("audit_disputed"), honest ? 0 : 1);
    EXPECT_TRUE(evicted_.empty());
  }
}

// A worker is held to the weight syncs its own two outputs claim, not to a
// verifier's word: p1s1 skips its updates and claims a sync between each
// (every verifier then rightly calls its update audits unverifiable) and
// is evicted once those pass what its job's syncs explain; p0s1 and p2s1,
// whose update audits the verifiers also call unverifiable (lying), claim
// none and stay.
TEST_F(AuditCoordinatorTest, AWorkerIsHeldToTheSyncsItsOwnOutputsClaim) {
  Make(1.0, uint64_t{1} << 30, /*audit_updates=*/true);
  int update_audits_of_dodger = 0;
  for (int step = 2; step <= 16 && evicted_.empty(); ++step) {
    audits_->OnCommitted(plan_, step, 2, {});
    std::map<std::string, v1::HeartbeatResponse> work;
    for (int r = 0; r < 3; ++r) {
      for (int k = 0; k < 2; ++k) work[PipelineWorker(r, k)] = Work(PipelineWorker(r, k));
    }
    for (const auto& [w, response] : work) {
      for (const v1::EvidenceRequest& q : response.evidence_requests()) {
        if (!q.update()) {
          ASSERT_TRUE(audits_->AcceptEvidence(w, Part(w, q)).ok());
          continue;
        }
        v1::AuditEvidence e;
        e.set_worker_id(w);
        e.set_audit_id(q.audit_id());
        e.set_part(q.part());
        e.set_found(true);
        const std::string first = std::to_string(q.microbatches(0));
        const std::string next = std::to_string(q.next_microbatch());
        switch (q.part()) {
          case v1::EvidenceRequest::SENT_INPUT:
            for (uint64_t m : q.microbatches()) {
              *e.add_messages() =
                  Message(v1::MESSAGE_KIND_ACTIVATION, m, "in" + std::to_string(m));
            }
            break;
          case v1::EvidenceRequest::CLAIM: {
            if (w == "p1s1") ++update_audits_of_dodger;
            *e.mutable_message() = Message(v1::MESSAGE_KIND_GRADIENT, q.microbatches(0),
                                           "out" + first);
            *e.mutable_next_message() =
                Message(v1::MESSAGE_KIND_GRADIENT, q.next_microbatch(), "out" + next);
            e.mutable_message()->mutable_header()->set_weight_syncs(step);
            e.mutable_next_message()->mutable_header()->set_weight_syncs(
                w == "p1s1" ? step + 1 : step);
            e.add_weights()->set_layer(1);
            e.add_weights_after()->set_layer(1);
            for (uint64_t m : q.microbatches()) {
              e.add_received_commitments("in" + std::to_string(m));
            }
            break;
          }
          case v1::EvidenceRequest::RECEIPT:
            e.set_received_commitment("out" + first);
            e.set_next_received_commitment("out" + next);
            break;
          default:
            ADD_FAILURE() << "stage 1 is the last: no downstream gradients to owe";
        }
        ASSERT_TRUE(audits_->AcceptEvidence(w, e).ok());
      }
    }
    // Every verifier asked, first or second: outputs pass, updates are
    // "unverifiable".
    for (int round = 0; round < 3; ++round) {
      for (int r = 0; r < 3; ++r) {
        const std::string verifier = PipelineWorker(r, 1);
        const v1::HeartbeatResponse asked = Work(verifier);
        for (uint64_t id : asked.verify_audits()) {
          absl::StatusOr<v1::AuditBundle> bundle = audits_->Fetch(verifier, id);
          ASSERT_TRUE(bundle.ok()) << bundle.status();
          v1::AuditVerdict verdict = Verdict(verifier, id, /*passed=*/true);
          if (bundle->update()) {
            verdict.set_passed(false);
            verdict.set_verifiable(false);
            verdict.set_summary("unverifiable: weight syncs between");
          }
          ASSERT_TRUE(audits_->AcceptVerdict(verifier, verdict, plan_, {}).ok());
        }
      }
    }
  }
  EXPECT_EQ(evicted_, std::vector<std::string>{"p1s1"});
  // Rate 0 (the fixture's job has no syncs): more than 4 from 8 audits.
  EXPECT_GE(update_audits_of_dodger, 8);
  EXPECT_LE(update_audits_of_dodger, 9);
  EXPECT_GT(EventsOf("audit_unverifiable"), 0);
}

// Steps are drawn once, a new plan's from where the old one's stopped.
TEST_F(AuditCoordinatorTest, EachCommittedStepIsDrawnOnce) {
  Make(1.0);
  audits_->OnCommitted(plan_, 3, 2, {});
  EXPECT_EQ(audits_->Figures().counts.drawn, 3 * 3 * 2);  // steps x pipelines x microbatches
  audits_->OnCommitted(plan_, 3, 2, {});
  EXPECT_EQ(audits_->Figures().counts.drawn, 18);
  v1::Plan next = plan_;
  next.set_epoch(plan_.epoch() + 1);
  audits_->OnCommitted(next, 3, 2, {});
  EXPECT_EQ(audits_->Figures().counts.drawn, 18);  // step 3 was the old plan's
  audits_->OnCommitted(next, 4, 2, {});
  EXPECT_EQ(audits_->Figures().counts.drawn, 24);
}

}  // namespace
}  // namespace geotrain
