#include "coordinator/checkpoint_store.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "common/job_spec.h"
#include "common/layer_state.h"
#include "common/model_profile.h"
#include "gtest/gtest.h"

namespace geotrain {
namespace {

std::string TempDir() {
  char pattern[] = "/tmp/checkpoint-store-XXXXXX";
  return mkdtemp(pattern);
}

v1::LayerCheckpoint Checkpoint(int layer, int step) {
  v1::LayerCheckpoint c;
  c.set_layer(layer);
  c.set_step(step);
  c.set_optimizer_steps(step * 4);
  c.set_payload(std::string(1000, static_cast<char>(step)));
  return c;
}

std::string PathOf(const CheckpointStore& store, int layer, int step) {
  char name[64];
  std::snprintf(name, sizeof(name), "/layer-%04d/step-%08d.ckpt", layer, step);
  return store.dir() + name;
}

TEST(CheckpointStoreTest, SavesLoadsTheNewestAndKeepsAFew) {
  auto store = CheckpointStore::Open(TempDir(), /*keep=*/2);
  ASSERT_TRUE(store.ok());
  for (int step : {10, 20, 30}) ASSERT_TRUE((*store)->Save(Checkpoint(3, step)).ok());
  ASSERT_TRUE((*store)->Save(Checkpoint(4, 10)).ok());
  auto latest = (*store)->LoadLatest(3, nullptr);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->step(), 30);
  EXPECT_EQ(latest->optimizer_steps(), 120);
  EXPECT_EQ(latest->payload(), std::string(1000, static_cast<char>(30)));
  EXPECT_EQ((*store)->Index(), (std::map<int, std::vector<int>>{{3, {20, 30}}, {4, {10}}}));
  EXPECT_EQ((*store)->LoadLatest(5, nullptr).status().code(), absl::StatusCode::kNotFound);
}

// Issue 32: a revoked worker's checkpoints leave nothing to restore if
// they are all that is kept (it uploaded the newest few); the newest of
// other uploaders stay besides them, and quarantine moves only its own.
TEST(CheckpointStoreTest, OtherUploadersCheckpointsOutliveAWorkersAndItsQuarantine) {
  const std::string dir = TempDir();
  auto store = CheckpointStore::Open(dir, /*keep=*/2);
  ASSERT_TRUE(store.ok());
  auto by = [](const std::string& worker, int step) {
    v1::LayerCheckpoint c = Checkpoint(1, step);
    c.set_worker_id(worker);
    return c;
  };
  for (int step : {10, 20}) ASSERT_TRUE((*store)->Save(by("honest", step)).ok());
  for (int step : {30, 40, 50, 60}) ASSERT_TRUE((*store)->Save(by("bad", step)).ok());
  EXPECT_EQ((*store)->Index(), (std::map<int, std::vector<int>>{{1, {20, 50, 60}}}))
      << "the newest two, and the newest of another uploader";
  // As a restart reads them from the files.
  store->reset();
  store = CheckpointStore::Open(dir, /*keep=*/2);
  ASSERT_TRUE(store.ok());
  absl::StatusOr<int> moved = (*store)->Quarantine("bad");
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, 2);
  EXPECT_EQ((*store)->LoadLatest(1, nullptr)->step(), 20);
  EXPECT_EQ((*store)->LoadLatest(1, nullptr)->worker_id(), "honest");
  EXPECT_TRUE(std::ifstream(dir + "/checkpoints/quarantine/layer-0001-step-00000060.ckpt").good());
}

// A revoked worker's upload that began before its quarantine and commits
// after it never reaches the index (a hostile-worker run restored such a
// checkpoint, newer than every trusted one).
TEST(CheckpointStoreTest, AnUploadInFlightAtTheQuarantineIsQuarantinedToo) {
  const std::string dir = TempDir();
  auto store = CheckpointStore::Open(dir, /*keep=*/3);
  ASSERT_TRUE(store.ok());
  v1::LayerCheckpoint honest = Checkpoint(1, 10);
  honest.set_worker_id("honest");
  ASSERT_TRUE((*store)->Save(honest).ok());
  v1::LayerCheckpoint late = Checkpoint(1, 20);
  late.set_worker_id("bad");
  const std::string payload = late.payload();
  late.clear_payload();
  auto writer = (*store)->BeginSave(late, payload.size());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Append(payload).ok());
  ASSERT_TRUE((*store)->Quarantine("bad").ok());
  EXPECT_EQ((*writer)->Commit().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ((*store)->Index(), (std::map<int, std::vector<int>>{{1, {10}}}));
  EXPECT_EQ((*store)->LoadLatest(1, nullptr)->worker_id(), "honest");
  EXPECT_TRUE(std::ifstream(dir + "/checkpoints/quarantine/layer-0001-step-00000020.ckpt").good());
  // Others still commit.
  v1::LayerCheckpoint next = Checkpoint(1, 30);
  next.set_worker_id("honest");
  ASSERT_TRUE((*store)->Save(next).ok());
  EXPECT_EQ((*store)->LoadLatest(1, nullptr)->step(), 30);
}

// Issue 35: the state a rollback goes back to outlives the pruning that
// keeps the newest few: each layer's newest checkpoint at or before the
// pinned step stays, and above it the newest of each of about 8 buckets,
// so that a pin that moves up still finds one near it.
TEST(CheckpointStoreTest, ThePinnedCheckpointAndAFewAboveItOutlivePruning) {
  auto store = CheckpointStore::Open(TempDir(), /*keep=*/2);
  ASSERT_TRUE(store.ok());
  (*store)->PinAtOrBefore(25);
  for (int step = 10; step <= 600; step += 10) {
    for (int layer : {0, 1}) ASSERT_TRUE((*store)->Save(Checkpoint(layer, step)).ok());
  }
  // 20: the pinned; 120-510: buckets of 128 steps; 590 and 600: the newest.
  const std::vector<int> kept = {20, 120, 250, 380, 510, 590, 600};
  EXPECT_EQ((*store)->Index(), (std::map<int, std::vector<int>>{{0, kept}, {1, kept}}));
  // The pin moves up to 300: 250 is the newest at or before it, and the
  // old pinned one goes at the next prune.
  (*store)->PinAtOrBefore(300);
  ASSERT_TRUE((*store)->Save(Checkpoint(0, 610)).ok());
  EXPECT_EQ((*store)->Index().at(0), (std::vector<int>{250, 380, 510, 600, 610}));
  // Without a pin, the newest few only.
  (*store)->PinAtOrBefore(-1);
  ASSERT_TRUE((*store)->Save(Checkpoint(0, 620)).ok());
  EXPECT_EQ((*store)->Index().at(0), (std::vector<int>{610, 620}));
}

// A rollback goes back to the newest step every layer has at or before
// the trusted one, moves the later checkpoints into quarantine (restores
// take exactly that step's), and refuses uploads begun before it.
TEST(CheckpointStoreTest, ARollbackQuarantinesLaterCheckpointsAndUploadsInFlight) {
  const std::string dir = TempDir();
  auto store = CheckpointStore::Open(dir, /*keep=*/5);
  ASSERT_TRUE(store.ok());
  for (int step : {10, 20, 30, 40}) ASSERT_TRUE((*store)->Save(Checkpoint(0, step)).ok());
  for (int step : {10, 30, 40}) ASSERT_TRUE((*store)->Save(Checkpoint(1, step)).ok());
  v1::LayerCheckpoint late = Checkpoint(1, 50);
  const std::string payload = late.payload();
  late.clear_payload();
  auto writer = (*store)->BeginSave(late, payload.size());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Append(payload).ok());

  EXPECT_EQ((*store)->RollBackTo(25, /*num_layers=*/2).status().code(),
            absl::StatusCode::kOk);
  // Layer 1 has no step 20: both go back to 10.
  EXPECT_EQ((*store)->Index(), (std::map<int, std::vector<int>>{{0, {10}}, {1, {10}}}));
  EXPECT_EQ((*store)->LoadLatest(0, nullptr)->step(), 10);
  EXPECT_TRUE(
      std::ifstream(dir + "/checkpoints/quarantine/layer-0000-step-00000040.rollback-1.ckpt")
          .good());
  EXPECT_EQ((*writer)->Commit().code(), absl::StatusCode::kAborted);
  EXPECT_EQ((*store)->Index().at(1), (std::vector<int>{10}));
  // Uploads begun after it commit.
  ASSERT_TRUE((*store)->Save(Checkpoint(1, 20)).ok());
  EXPECT_EQ((*store)->LoadLatest(1, nullptr)->step(), 20);
}

TEST(CheckpointStoreTest, ARollbackWithNoCommonStepGoesBackToTheSeed) {
  auto store = CheckpointStore::Open(TempDir(), /*keep=*/3);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Save(Checkpoint(0, 10)).ok());
  ASSERT_TRUE((*store)->Save(Checkpoint(1, 20)).ok());
  absl::StatusOr<CheckpointStore::Rollback> rollback = (*store)->RollBackTo(30, 2);
  ASSERT_TRUE(rollback.ok()) << rollback.status();
  EXPECT_EQ(rollback->step, 0);
  EXPECT_EQ(rollback->moved, 2);
  EXPECT_EQ((*store)->LoadLatest(0, nullptr).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*store)->RollBackTo(30, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckpointStoreTest, ARestartedStoreFindsEverything) {
  const std::string dir = TempDir();
  {
    auto store = CheckpointStore::Open(dir);
    ASSERT_TRUE((*store)->Save(Checkpoint(0, 7)).ok());
  }
  auto reopened = CheckpointStore::Open(dir);
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ((*reopened)->LoadLatest(0, nullptr)->step(), 7);
}

// Each way a file can be damaged: the previous checkpoint is used instead,
// and the damaged file is named.
TEST(CheckpointStoreTest, ACorruptCheckpointFallsBackToThePreviousOne) {
  struct Damage {
    const char* name;
    void (*apply)(const std::string& path);
  };
  const Damage damages[] = {
      {"flipped byte",
       [](const std::string& path) {
         std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(500);
         f.put('\x5a');
       }},
      {"truncated", [](const std::string& path) { ASSERT_EQ(truncate(path.c_str(), 100), 0); }},
      {"empty", [](const std::string& path) { std::ofstream f(path, std::ios::trunc); }},
      {"garbage", [](const std::string& path) { std::ofstream(path) << "not a checkpoint"; }},
  };
  for (const Damage& damage : damages) {
    auto store = CheckpointStore::Open(TempDir());
    ASSERT_TRUE((*store)->Save(Checkpoint(1, 10)).ok());
    ASSERT_TRUE((*store)->Save(Checkpoint(1, 20)).ok());
    damage.apply(PathOf(**store, 1, 20));
    std::vector<std::string> skipped;
    auto latest = (*store)->LoadLatest(1, &skipped);
    ASSERT_TRUE(latest.ok()) << damage.name;
    EXPECT_EQ(latest->step(), 10) << damage.name;
    ASSERT_EQ(skipped.size(), 1u) << damage.name;
    EXPECT_NE(skipped[0].find("step-00000020.ckpt"), std::string::npos) << skipped[0];
  }
}

TEST(CheckpointStoreTest, AFileUnderTheWrongNameIsRefused) {
  auto store = CheckpointStore::Open(TempDir());
  ASSERT_TRUE((*store)->Save(Checkpoint(2, 10)).ok());
  ASSERT_TRUE((*store)->Save(Checkpoint(2, 20)).ok());
  // Step 10's file copied over step 20's: intact, but not step 20.
  std::ifstream in(PathOf(**store, 2, 10), std::ios::binary);
  std::ofstream(PathOf(**store, 2, 20), std::ios::binary | std::ios::trunc) << in.rdbuf();
  std::vector<std::string> skipped;
  EXPECT_EQ((*store)->LoadLatest(2, &skipped)->step(), 10);
  EXPECT_EQ(skipped.size(), 1u);
}

// A layer is written and read a piece at a time; the reader hands back the
// same bytes; a writer dropped before Commit leaves no file and no index
// entry.
TEST(CheckpointStoreTest, StreamsALayerInAndOutInPieces) {
  auto store = CheckpointStore::Open(TempDir());
  ASSERT_TRUE(store.ok());
  v1::LayerCheckpoint header = Checkpoint(5, 40);
  std::string payload(3 << 20, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i % 251);
  header.clear_payload();
  {
    auto writer = (*store)->BeginSave(header, payload.size());
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->Append(absl::string_view(payload).substr(0, 1000)).ok());
  }  // abandoned
  EXPECT_TRUE((*store)->Index().empty() || (*store)->Index().at(5).empty());
  auto writer = (*store)->BeginSave(header, payload.size());
  ASSERT_TRUE(writer.ok());
  for (size_t offset = 0; offset < payload.size(); offset += 1 << 20) {
    ASSERT_TRUE((*writer)->Append(absl::string_view(payload).substr(offset, 1 << 20)).ok());
  }
  EXPECT_EQ((*writer)->Append("x").code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*writer)->Commit().ok());
  auto reader = (*store)->OpenLatest(5, nullptr);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->header().step(), 40);
  EXPECT_TRUE((*reader)->header().payload().empty());
  ASSERT_EQ((*reader)->payload_bytes(), payload.size());
  std::string read;
  while (true) {
    auto n = (*reader)->Read(777777, &read);
    ASSERT_TRUE(n.ok());
    if (*n == 0) break;
  }
  EXPECT_EQ(read, payload);
  // Nothing else was left in the layer's directory (no temp files).
  int files = 0;
  for (int step = 0; step < 100; ++step) files += access(PathOf(**store, 5, step).c_str(), F_OK) == 0;
  EXPECT_EQ(files, 1);
}

TEST(CheckpointStoreTest, AWriterMustDeliverWhatItAnnounced) {
  auto store = CheckpointStore::Open(TempDir());
  v1::LayerCheckpoint header = Checkpoint(1, 1);
  header.clear_payload();
  auto writer = (*store)->BeginSave(header, 10);
  ASSERT_TRUE((*writer)->Append("12345").ok());
  EXPECT_EQ((*writer)->Commit().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*store)->LoadLatest(1, nullptr).status().code(), absl::StatusCode::kNotFound);
}

// A state directory written by the previous format is still read.
TEST(CheckpointStoreTest, ReadsFilesOfThePreviousFormat) {
  const std::string dir = TempDir();
  const v1::LayerCheckpoint old = Checkpoint(2, 30);
  const std::string body = old.SerializeAsString();
  std::string file = "GTCKPT01";
  const uint32_t crc = Crc32Update(0, body);
  for (int i = 0; i < 4; ++i) file.push_back(static_cast<char>(crc >> (8 * i)));
  for (int i = 0; i < 8; ++i) file.push_back(static_cast<char>(uint64_t{body.size()} >> (8 * i)));
  file += body;
  ASSERT_EQ(system(("mkdir -p " + dir + "/checkpoints/layer-0002").c_str()), 0);
  std::ofstream(dir + "/checkpoints/layer-0002/step-00000030.ckpt", std::ios::binary) << file;
  auto store = CheckpointStore::Open(dir);
  auto loaded = (*store)->LoadLatest(2, nullptr);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->SerializeAsString(), old.SerializeAsString());
}

}  // namespace
// With pipelines a layer's checkpoint also holds the outer optimizer's
// weights and momentum: one float32 tensor per parameter, of its shape.
TEST(CheckpointStoreTest, OuterTensorsMustMatchTheParameters) {
  absl::StatusOr<v1::JobSpec> job =
      ParseJobSpec("mlp { hidden: 8 } fashion_mnist {} steps: 4 outer { }", "outer_ckpt");
  ASSERT_TRUE(job.ok()) << job.status();
  v1::LayerCheckpoint c;
  c.set_layer(0);
  c.set_step(2);
  uint64_t bytes = 0;
  auto add = [&bytes](v1::TensorHeader* h, const std::vector<int64_t>& shape) {
    uint64_t n = 1;
    for (int64_t d : shape) {
      h->add_shape(d);
      n *= static_cast<uint64_t>(d);
    }
    h->set_dtype(v1::DTYPE_FLOAT32);
    h->set_codec(v1::CODEC_NONE);
    h->set_payload_bytes(4 * n);
    bytes += 4 * n;
  };
  const std::vector<ParameterSpec> params = LayerParameters(*job, 0);
  for (const ParameterSpec& p : params) add(c.add_params(), p.shape);
  for (const ParameterSpec& p : params) add(c.add_outer_weights(), p.shape);
  for (const ParameterSpec& p : params) add(c.add_outer_momentum(), p.shape);
  c.set_outer_rounds(3);
  EXPECT_TRUE(CheckLayerCheckpointHeader(*job, c, bytes).ok())
      << CheckLayerCheckpointHeader(*job, c, bytes);
  EXPECT_EQ(DeclaredPayloadBytes(c), bytes);
  EXPECT_LE(bytes, MaxLayerStateBytes(*job, 0));
  v1::LayerCheckpoint wrong_shape = c;
  wrong_shape.mutable_outer_momentum(0)->set_shape(0, 3);
  EXPECT_FALSE(CheckLayerCheckpointHeader(*job, wrong_shape, bytes).ok());
  v1::LayerCheckpoint too_few = c;
  too_few.mutable_outer_weights()->RemoveLast();
  EXPECT_FALSE(CheckLayerCheckpointHeader(*job, too_few, bytes).ok());
  v1::LayerCheckpoint momentum_alone = c;
  momentum_alone.clear_outer_weights();
  EXPECT_FALSE(CheckLayerCheckpointHeader(*job, momentum_alone, bytes).ok());
}

}  // namespace geotrain
