// CheckpointGate on its own: a plan set by hand (PlanView), leases on a
// FakeClock, a ProgressGate driven directly, and a CheckpointStore in a
// temporary directory. No controller.
#include "coordinator/checkpoint_gate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>

#include "common/clock.h"
#include "common/job_spec.h"
#include "common/model_profile.h"
#include "common/layer_state.h"

namespace geotrain {
namespace {

class CheckpointGateTest : public testing::Test {
 protected:
  void SetUp() override {
    auto job = ParseJobSpec("gpt { context: 8 d_model: 16 heads: 2 blocks: 2 } text {} "
                            "steps: 3000 min_workers: 2",
                            "test");
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *job;
    dir_ = testing::TempDir() + "/checkpoint_gate_" +
           testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    auto store = CheckpointStore::Open(dir_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    EventLogOptions events;
    events.clock = &clock_;
    events_ = std::make_unique<EventLog>(std::move(events));
    first_ = membership_.Join("a", "a:1", {}).id;
    last_ = membership_.Join("b", "b:1", {}).id;
    // Two stages: a holds layers [0, 2), b [2, 4).
    v1::Plan plan;
    plan.set_epoch(1);
    v1::StageAssignment* stage0 = plan.add_stages();
    stage0->set_stage(0);
    stage0->set_worker_id(first_);
    stage0->set_layer_begin(0);
    stage0->set_layer_end(2);
    v1::StageAssignment* stage1 = plan.add_stages();
    stage1->set_stage(1);
    stage1->set_worker_id(last_);
    stage1->set_layer_begin(2);
    stage1->set_layer_end(4);
    plan_.Set(std::make_shared<const v1::Plan>(plan));
    progress_.StartEpoch(1, 0, {{first_, 0}}, {{last_, 0}});
    CheckpointGateOptions options;
    options.job = &job_;
    options.store = store_.get();
    options.plan = &plan_;
    options.membership = &membership_;
    options.progress = &progress_;
    options.events = events_.get();
    options.lead_steps = 4;
    gate_ = std::make_unique<CheckpointGate>(options);
  }

  // Steps 1..`steps` claimed by the last stage and finished by stage 0.
  void Commit(int steps) {
    for (int step = 1; step <= steps; ++step) {
      ProgressGate::Step claim;
      claim.step = step;
      claim.samples = 8;
      ASSERT_TRUE(progress_.Claim(last_, 1, claim).ok());
      progress_.FirstStageFinished(first_, 1, step);
    }
  }

  // A checkpoint of `layer` that fits the model (ZeroLayerCheckpoint).
  v1::LayerCheckpoint Fitting(const std::string& worker, int layer, int step,
                         int state_per_param = 0) {
    return geotrain::ZeroLayerCheckpoint(job_, worker, layer, step, state_per_param);
  }

  int EventsOf(const std::string& kind) {
    int n = 0;
    for (const v1::Event& e : events_->Recent()) n += e.kind() == kind;
    return n;
  }

  FakeClock clock_{1000};
  v1::JobSpec job_;
  std::string dir_;
  std::unique_ptr<CheckpointStore> store_;
  std::unique_ptr<EventLog> events_;
  Membership membership_{&clock_, 5000};
  PlanView plan_;
  ProgressGate progress_{ProgressGateOptions{3000, 64}};
  std::unique_ptr<CheckpointGate> gate_;
  std::string first_, last_;
};

TEST_F(CheckpointGateTest, CheckpointsMustFitTheModelAndComeFromTheStagesPrimary) {
  const int layer = 2;  // the last stage's
  ASSERT_TRUE(gate_->Save(Fitting(last_, layer, 2)).ok());
  // AdamW's layout: the parameters, then m and v of each, in parameter order.
  EXPECT_TRUE(gate_->Save(Fitting(last_, layer, 1, 2)).ok());
  {
    // The same values re-cut into one flat tensor: the element count fits,
    // the shapes do not, and a restore could not load it (issue 32).
    v1::LayerCheckpoint flat = Fitting(last_, layer, 2);
    v1::TensorHeader whole = flat.params(0);
    whole.clear_shape();
    whole.add_shape(static_cast<int64_t>(flat.payload().size() / 4));
    whole.set_payload_bytes(flat.payload().size());
    whole.set_encoded_bytes(flat.payload().size());
    flat.clear_params();
    *flat.add_params() = whole;
    const absl::Status refused = gate_->Save(flat);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_NE(refused.message().find("parameters; the layer has"), std::string::npos) << refused;
    // One parameter transposed: the same count, a shape of its own.
    v1::LayerCheckpoint transposed = Fitting(last_, layer, 2);
    for (v1::TensorHeader& h : *transposed.mutable_params()) {
      if (h.shape_size() == 2 && h.shape(0) != h.shape(1)) {
        const int64_t rows = h.shape(0);
        h.set_shape(0, h.shape(1));
        h.set_shape(1, rows);
        break;
      }
    }
    const absl::Status shape = gate_->Save(transposed);
    EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument) << shape;
    EXPECT_NE(shape.message().find("has shape ["), std::string::npos) << shape;
  }
  // (Step 2 again: a later one would be refused for its step alone, as no
  // step is committed yet.)
  v1::LayerCheckpoint nan = Fitting(last_, layer, 2);
  const float bad = std::nanf("");
  std::memcpy(nan.mutable_payload()->data() + 8, &bad, 4);
  EXPECT_EQ(gate_->Save(nan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gate_->Save(Fitting(last_, layer, 2147483000)).code(),
            absl::StatusCode::kInvalidArgument);
  v1::LayerCheckpoint shape = Fitting(last_, layer, 2);
  shape.mutable_params(0)->set_shape(0, shape.params(0).shape(0) - 1);
  shape.mutable_params(0)->set_payload_bytes(shape.params(0).payload_bytes() - 4);
  shape.mutable_params(0)->set_encoded_bytes(shape.params(0).encoded_bytes() - 4);
  shape.mutable_payload()->resize(shape.payload().size() - 4);
  EXPECT_EQ(gate_->Save(shape).code(), absl::StatusCode::kInvalidArgument);
  // Stage 0's worker may not write the last stage's layers.
  EXPECT_EQ(gate_->Save(Fitting(first_, layer, 2)).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_GE(EventsOf("checkpoint_refused"), 5);
  // The good one is still the latest, and only its stage may read it.
  absl::StatusOr<v1::LayerCheckpoint> latest = gate_->Load(last_, layer);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->step(), 2);
  EXPECT_EQ(EventsOf("restore"), 1);
  EXPECT_EQ(gate_->Load(first_, layer).status().code(), absl::StatusCode::kPermissionDenied);
  absl::StatusOr<v1::LayerCheckpoint> probe = gate_->Load(last_, layer, /*probe=*/true);
  ASSERT_TRUE(probe.ok());
  EXPECT_EQ(probe->step(), 2);
  EXPECT_TRUE(probe->payload().empty());
  EXPECT_EQ(EventsOf("restore"), 1) << "a probe restores nothing";
}

TEST_F(CheckpointGateTest, ACheckpointCannotOutrunTheJob) {
  Commit(10);
  EXPECT_TRUE(gate_->Save(Fitting(last_, 2, 10)).ok());
  EXPECT_TRUE(gate_->Save(Fitting(last_, 2, 14)).ok()) << "within the lead";
  const absl::Status future = gate_->Save(Fitting(last_, 2, 3000));
  EXPECT_EQ(future.code(), absl::StatusCode::kFailedPrecondition) << future;
  EXPECT_NE(future.message().find("the job has reached step 10"), std::string::npos) << future;
  EXPECT_EQ(gate_->Load(last_, 2)->step(), 14);
}

TEST_F(CheckpointGateTest, AWorkerWhoseLeaseEndedOrWithoutAPlanUploadsNothing) {
  ASSERT_TRUE(membership_.Leave(last_, "left"));
  const absl::Status ended = gate_->Save(Fitting(last_, 2, 1));
  EXPECT_EQ(ended.code(), absl::StatusCode::kPermissionDenied) << ended;
  EXPECT_NE(ended.message().find("whose lease has ended"), std::string::npos) << ended;
  plan_.Set(nullptr);
  EXPECT_EQ(gate_->Save(Fitting(first_, 0, 1)).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(gate_->Load(first_, 0).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(gate_->Load(first_, 0, /*probe=*/true).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(CheckpointGateTest, StateTrafficIsCounted) {
  gate_->CountReceived(100);
  gate_->CountReceived(50);
  gate_->CountSent(7);
  v1::StateTraffic traffic;
  gate_->FillTraffic(&traffic);
  EXPECT_EQ(traffic.checkpoint_bytes_received(), 150u);
  EXPECT_EQ(traffic.layers_received(), 2u);
  EXPECT_EQ(traffic.checkpoint_bytes_sent(), 7u);
  EXPECT_EQ(traffic.layers_sent(), 1u);
}

}  // namespace
}  // namespace geotrain
