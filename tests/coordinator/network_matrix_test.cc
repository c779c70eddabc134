#include "coordinator/network_matrix.h"

#include <gtest/gtest.h>

#include <set>

namespace geotrain {
namespace {

std::vector<WorkerRecord> Workers(int n) {
  std::vector<WorkerRecord> workers;
  for (int i = 0; i < n; ++i) {
    WorkerRecord w;
    w.id = "w" + std::to_string(i);
    w.address = "10.0.0." + std::to_string(i) + ":7000";
    workers.push_back(w);
  }
  return workers;
}

v1::ProbeResult Measured(const std::string& to, double rtt, double rate) {
  v1::ProbeResult r;
  r.set_worker_id(to);
  r.set_measured(true);
  r.set_reachable(true);
  r.set_rtt_s(rtt);
  r.set_rate_bps(rate);
  return r;
}

TEST(NetworkMatrixTest, EachWorkerMeasuresABoundedSampleOneTaskAtATime) {
  NetworkMatrixOptions options;
  options.sample = 3;
  NetworkMatrix matrix(options);
  const std::vector<WorkerRecord> live = Workers(10);
  std::set<std::string> measured;
  int64_t now = 1000;
  for (int round = 0; round < 10; ++round) {
    std::optional<v1::ProbeTask> task = matrix.NextTask("w0", live, now);
    if (!task.has_value()) break;
    EXPECT_NE(task->worker_id(), "w0");
    EXPECT_EQ(task->measure_bytes(), options.probe_bytes);
    // One outstanding task: nothing more until it is answered.
    EXPECT_FALSE(matrix.NextTask("w0", live, now).has_value());
    EXPECT_FALSE(matrix.WantsTask("w0", now));
    matrix.RecordProbe("w0", Measured(task->worker_id(), 0.01, 1e8), now);
    measured.insert(task->worker_id());
    now += 100;
  }
  EXPECT_EQ(measured.size(), 3u);
  EXPECT_TRUE(matrix.SampleMeasured("w0", live));
  EXPECT_FALSE(matrix.SampleMeasured("w1", live));
  EXPECT_FALSE(matrix.NextTask("w0", live, now).has_value());
  // After the refresh period the oldest pair is measured again.
  now += options.refresh_ms + 1;
  EXPECT_TRUE(matrix.WantsTask("w0", now));
  EXPECT_TRUE(matrix.NextTask("w0", live, now).has_value());
}

TEST(NetworkMatrixTest, AFailedProbeIsNotRetriedBeforeTheRefreshAndClearsOldFigures) {
  NetworkMatrixOptions options;
  options.sample = 3;
  NetworkMatrix matrix(options);
  const std::vector<WorkerRecord> live = Workers(4);
  std::set<std::string> asked;
  for (int round = 0; round < 3; ++round) {
    std::optional<v1::ProbeTask> task = matrix.NextTask("w0", live, 1000 + round);
    ASSERT_TRUE(task.has_value());
    asked.insert(task->worker_id());
    v1::ProbeResult failed;
    failed.set_worker_id(task->worker_id());
    failed.set_measured(true);
    failed.set_reachable(false);
    matrix.RecordProbe("w0", failed, 1000 + round);
  }
  EXPECT_EQ(asked.size(), 3u) << "every peer of the sample was asked once";
  EXPECT_TRUE(matrix.SampleMeasured("w0", live));
  EXPECT_FALSE(matrix.NextTask("w0", live, 2000).has_value());
}

TEST(NetworkMatrixTest, AnswersNotAskedForOrImplausibleCarryNoFigures) {
  NetworkMatrix matrix;
  const std::vector<WorkerRecord> live = Workers(3);
  // Not asked: ignored.
  matrix.RecordProbe("w0", Measured("w1", 0.01, 1e8), 0);
  EXPECT_FALSE(matrix.Get("w0", "w1").has_value());
  std::optional<v1::ProbeTask> task = matrix.NextTask("w0", live, 0);
  ASSERT_TRUE(task.has_value());
  // Asked, but absurd (a forged 1 Pb/s): kept as a failed probe.
  matrix.RecordProbe("w0", Measured(task->worker_id(), 0.01, 1e15), 0);
  std::optional<NetworkMatrix::Entry> entry = matrix.Get("w0", task->worker_id());
  ASSERT_TRUE(entry.has_value());
  EXPECT_EQ(entry->rate_bps, 0);
  EXPECT_EQ(entry->rtt_s, 0);
}

TEST(NetworkMatrixTest, LiveLinkRatesRefreshThePairsAndGoIntoThePlannersLinks) {
  NetworkMatrix matrix;
  const std::vector<WorkerRecord> live = Workers(3);
  for (const WorkerRecord& w : live) matrix.Learn(w.id, w.address);
  std::optional<v1::ProbeTask> task = matrix.NextTask("w0", live, 0);
  ASSERT_TRUE(task.has_value());
  matrix.RecordProbe("w0", Measured(task->worker_id(), 0.040, 2e8), 0);
  matrix.RecordLinkRate("w1", live[2].address, 5e7, 10);
  matrix.RecordLinkRate("w1", "192.0.2.9:1", 5e7, 10);  // nobody's address
  std::vector<LinkEstimate> links = matrix.LinksFor(live);
  ASSERT_EQ(links.size(), 9u);
  const int probed = task->worker_id() == "w1" ? 1 : 2;
  EXPECT_DOUBLE_EQ(links[0 * 3 + probed].rate_bps, 2e8);
  EXPECT_DOUBLE_EQ(links[0 * 3 + probed].rtt_s, 0.040);
  EXPECT_DOUBLE_EQ(links[1 * 3 + 2].rate_bps, 5e7);
  EXPECT_EQ(matrix.Get("w1", "w2")->source, "link");
  std::vector<v1::NetworkLink> status = matrix.Status(2010);
  ASSERT_EQ(status.size(), 2u);
  EXPECT_NEAR(status[1].age_s(), 2.0, 1e-9);
  // A member that leaves takes its pairs with it.
  matrix.Forget("w2");
  EXPECT_FALSE(matrix.Get("w1", "w2").has_value());
}

}  // namespace
}  // namespace geotrain
