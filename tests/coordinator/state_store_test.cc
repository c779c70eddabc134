#include "coordinator/state_store.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace geotrain {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(StateStoreTest, WritesPlanAtomicallyAndAppendsEvents) {
  const std::string dir = testing::TempDir() + "/state_store_test/nested";
  std::filesystem::remove_all(testing::TempDir() + "/state_store_test");
  absl::StatusOr<StateStore> store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  v1::Plan plan;
  plan.set_epoch(3);
  ASSERT_TRUE(store->WritePlan(plan).ok());
  plan.set_epoch(4);
  ASSERT_TRUE(store->WritePlan(plan).ok());
  EXPECT_EQ(Read(dir + "/plan.textproto"), "epoch: 4\n");
  EXPECT_FALSE(std::filesystem::exists(dir + "/plan.textproto.tmp"));
  EXPECT_EQ(store->events_log_path(), dir + "/events.log");
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

TEST(StateStoreTest, TheStateIsTwoPartsJoinedOnRead) {
  const std::string dir = testing::TempDir() + "/state_store_parts";
  std::filesystem::remove_all(dir);
  absl::StatusOr<StateStore> store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::optional<v1::CoordinatorState>> nothing = store->ReadState();
  ASSERT_TRUE(nothing.ok());
  EXPECT_FALSE(nothing->has_value());
  v1::CoordinatorState members;
  members.add_members()->set_id("w0");
  members.set_next_worker_number(1);
  v1::CoordinatorState progress;
  progress.set_step(7);
  progress.set_done(true);
  ASSERT_TRUE(store->WriteMembers(members).ok());
  ASSERT_TRUE(store->WriteProgress(progress).ok());
  progress.set_step(8);
  ASSERT_TRUE(store->WriteProgress(progress).ok());
  absl::StatusOr<std::optional<v1::CoordinatorState>> state = store->ReadState();
  ASSERT_TRUE(state.ok() && state->has_value());
  EXPECT_EQ((*state)->members_size(), 1);
  EXPECT_EQ((*state)->next_worker_number(), 1);
  EXPECT_EQ((*state)->step(), 8);
  EXPECT_TRUE((*state)->done());
  EXPECT_EQ(Read(dir + "/progress.textproto"), "step: 8\ndone: true\n");
  WriteText(dir + "/progress.textproto", "step: oops");
  EXPECT_EQ(store->ReadState().status().code(), absl::StatusCode::kDataLoss);
}

TEST(StateStoreTest, AStateDirFromBeforeTheSplitIsReadThenReplaced) {
  const std::string dir = testing::TempDir() + "/state_store_joined";
  std::filesystem::remove_all(dir);
  absl::StatusOr<StateStore> store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  WriteText(dir + "/state.textproto",
            "members { id: \"w0\" name: \"a\" } step: 5 next_worker_number: 1\n");
  absl::StatusOr<std::optional<v1::CoordinatorState>> state = store->ReadState();
  ASSERT_TRUE(state.ok() && state->has_value()) << state.status();
  EXPECT_EQ((*state)->members(0).name(), "a");
  EXPECT_EQ((*state)->step(), 5);
  // The members written, the progress not yet (a crash between the two):
  // the old file still gives the progress.
  v1::CoordinatorState members;
  members.add_members()->set_name("b");
  ASSERT_TRUE(store->WriteMembers(members).ok());
  state = store->ReadState();
  ASSERT_TRUE(state.ok() && state->has_value());
  EXPECT_EQ((*state)->members(0).name(), "b");
  EXPECT_EQ((*state)->step(), 5);
  v1::CoordinatorState progress;
  progress.set_step(6);
  ASSERT_TRUE(store->WriteProgress(progress).ok());
  EXPECT_FALSE(std::filesystem::exists(dir + "/state.textproto"));
  state = store->ReadState();
  ASSERT_TRUE(state.ok() && state->has_value());
  EXPECT_EQ((*state)->step(), 6);
  EXPECT_EQ((*state)->members(0).name(), "b");
}

TEST(StateStoreTest, UnusableDirectoryIsAnError) {
  EXPECT_FALSE(StateStore::Open("/proc/self/geotrain").ok());
}

}  // namespace
}  // namespace geotrain
