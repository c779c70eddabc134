#include "coordinator/checkpoint_store.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>

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

}  // namespace
}  // namespace geotrain
