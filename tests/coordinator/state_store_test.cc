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

TEST(StateStoreTest, UnusableDirectoryIsAnError) {
  EXPECT_FALSE(StateStore::Open("/proc/self/geotrain").ok());
}

}  // namespace
}  // namespace geotrain
