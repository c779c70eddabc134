#include "coordinator/network_matrix.h"

#include <gtest/gtest.h>

#include <algorithm>
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

// Every peer `worker` is asked to measure until it has nothing left to ask.
std::vector<std::string> MeasureAll(NetworkMatrix* matrix, const std::string& worker,
                                    const std::vector<WorkerRecord>& live, uint64_t generation,
                                    int64_t* now) {
  std::vector<std::string> asked;
  for (int round = 0; round < 100; ++round) {
    std::optional<v1::ProbeTask> task = matrix->NextTask(worker, live, *now, generation);
    if (!task.has_value()) break;
    asked.push_back(task->worker_id());
    matrix->RecordProbe(worker, Measured(task->worker_id(), 0.01, 1e8), *now);
    *now += 100;
  }
  return asked;
}

TEST(NetworkMatrixTest, AKeptSampleFollowsTheLiveListAsARankedOneWould) {
  // One matrix ranks every member per task (no generation); the other keeps
  // each sample and ranks only newcomers while the list's generation holds.
  NetworkMatrixOptions options;
  options.sample = 4;
  NetworkMatrix fresh(options);
  NetworkMatrix kept(options);
  std::vector<WorkerRecord> live = Workers(12);
  int64_t fresh_now = 1000;
  int64_t kept_now = 1000;
  const std::vector<std::string> first = MeasureAll(&fresh, "w0", live, 0, &fresh_now);
  EXPECT_EQ(first.size(), 4u);
  EXPECT_EQ(MeasureAll(&kept, "w0", live, 1, &kept_now), first);
  // Newcomers are appended in the same generation: those that rank into
  // the sample are asked for, by both alike.
  std::vector<WorkerRecord> more = Workers(200);
  for (size_t i = live.size(); i < more.size(); ++i) {
    live.push_back(more[i]);
    fresh.Learn(more[i].id, more[i].address);
    kept.Learn(more[i].id, more[i].address);
  }
  const std::vector<std::string> grown = MeasureAll(&fresh, "w0", live, 0, &fresh_now);
  EXPECT_FALSE(grown.empty());
  EXPECT_EQ(MeasureAll(&kept, "w0", live, 1, &kept_now), grown);
  // A member of the sample leaves: a new list, a new generation, and the
  // next-ranked member is asked for.
  const std::string gone = grown.front();
  live.erase(std::find_if(live.begin(), live.end(),
                          [&](const WorkerRecord& w) { return w.id == gone; }));
  fresh.Forget(gone);
  kept.Forget(gone);
  const std::vector<std::string> after = MeasureAll(&fresh, "w0", live, 0, &fresh_now);
  ASSERT_EQ(after.size(), 1u);
  EXPECT_NE(after.front(), gone);
  EXPECT_EQ(MeasureAll(&kept, "w0", live, 2, &kept_now), after);
  EXPECT_TRUE(kept.SampleMeasured("w0", live));
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

v1::AccessProbeResult AccessMeasured(double up, double down, int peers) {
  v1::AccessProbeResult r;
  r.set_measured(true);
  r.set_uplink_bps(up);
  r.set_downlink_bps(down);
  r.set_peers(peers);
  return r;
}

// A worker's port is measured once two peers of its sample answered its
// measures: with its fastest measured peers (3 at most), one task at a time,
// and again after the refresh; the figures reach the planner's workers.
TEST(NetworkMatrixTest, AnAccessMeasurementFollowsTwoMeasuredPeers) {
  NetworkMatrixOptions options;
  options.sample = 5;
  NetworkMatrix matrix(options);
  const std::vector<WorkerRecord> live = Workers(6);
  int64_t now = 1000;
  EXPECT_FALSE(matrix.NextAccessTask("w0", live, now).has_value());
  // Nothing to measure with yet (the first plan waits for the sample's
  // measures before it looks at this).
  EXPECT_TRUE(matrix.AccessSettled("w0", live));
  std::vector<std::string> order;
  for (int i = 0; i < 5; ++i) {
    std::optional<v1::ProbeTask> task = matrix.NextTask("w0", live, now);
    ASSERT_TRUE(task.has_value());
    // Rates 10, 20, 30, ... Mb/s in the order measured; the third fails.
    if (i == 2) {
      v1::ProbeResult failed;
      failed.set_worker_id(task->worker_id());
      failed.set_measured(true);
      matrix.RecordProbe("w0", failed, now);
    } else {
      matrix.RecordProbe("w0", Measured(task->worker_id(), 0.01, 1e7 * (i + 1)), now);
    }
    order.push_back(task->worker_id());
    if (i == 0) EXPECT_FALSE(matrix.NextAccessTask("w0", live, now).has_value());
  }
  EXPECT_FALSE(matrix.AccessSettled("w0", live));  // two peers answered: worth the wait
  std::optional<v1::AccessProbeTask> access = matrix.NextAccessTask("w0", live, now);
  ASSERT_TRUE(access.has_value());
  EXPECT_EQ(access->measure_bytes(), options.probe_bytes);
  ASSERT_EQ(access->peers_size(), 3);
  EXPECT_EQ(access->peers(0).worker_id(), order[4]);  // 50 Mb/s
  EXPECT_EQ(access->peers(1).worker_id(), order[3]);  // 40
  EXPECT_EQ(access->peers(2).worker_id(), order[1]);  // 20; the failed one is not asked
  EXPECT_FALSE(access->peers(0).address().empty());
  EXPECT_FALSE(matrix.NextAccessTask("w0", live, now).has_value());  // one at a time
  // An answer nobody asked for (another worker's) is ignored.
  matrix.RecordAccess("w1", AccessMeasured(5e7, 5e7, 3), now);
  EXPECT_FALSE(matrix.AccessOf("w1").has_value());
  matrix.RecordAccess("w0", AccessMeasured(1e8, 2e8, 3), now);
  ASSERT_TRUE(matrix.AccessOf("w0").has_value());
  EXPECT_EQ(matrix.AccessOf("w0")->uplink_bps, 1e8);
  EXPECT_EQ(matrix.AccessOf("w0")->downlink_bps, 2e8);
  EXPECT_TRUE(matrix.AccessSettled("w0", live));
  // A second answer to the same task is not asked for either.
  matrix.RecordAccess("w0", AccessMeasured(1e6, 1e6, 3), now);
  EXPECT_EQ(matrix.AccessOf("w0")->uplink_bps, 1e8);
  std::vector<PlannerWorkerInfo> workers(2);
  workers[0].id = "w1";
  workers[1].id = "w0";
  matrix.FillAccess(&workers);
  EXPECT_EQ(workers[0].uplink_bps, 0);
  EXPECT_EQ(workers[1].uplink_bps, 1e8);
  EXPECT_EQ(workers[1].downlink_bps, 2e8);
  // A pair measured faster than the port read (the measurement met other
  // traffic): the port is at least that fast.
  matrix.Learn(order[4], "10.0.0.9:7000");
  matrix.RecordLinkRate("w0", "10.0.0.9:7000", 1.5e8, now);
  matrix.FillAccess(&workers);
  EXPECT_EQ(workers[1].uplink_bps, 1.5e8);
  EXPECT_EQ(workers[1].downlink_bps, 2e8);
  EXPECT_EQ(matrix.AccessOf("w0")->uplink_bps, 1.5e8);  // status says the same
  EXPECT_FALSE(matrix.NextAccessTask("w0", live, now + 1000).has_value());
  EXPECT_TRUE(matrix.NextAccessTask("w0", live, now + options.refresh_ms + 1).has_value());
  // Forgotten with the worker.
  matrix.Forget("w0");
  EXPECT_FALSE(matrix.AccessOf("w0").has_value());
}

// Two measurements through one port would each read part of it: an access
// task waits while another task loads one of its ports, and a measure task
// waits while an access task loads either end's.
TEST(NetworkMatrixTest, NoTwoMeasurementsShareAPort) {
  NetworkMatrixOptions options;
  options.sample = 2;
  NetworkMatrix matrix(options);
  const std::vector<WorkerRecord> live = Workers(3);
  int64_t now = 1000;
  for (const char* worker : {"w0", "w1", "w2"}) {
    ASSERT_EQ(MeasureAll(&matrix, worker, live, 0, &now).size(), 2u) << worker;
  }
  // w0's access task loads w0, w1 and w2: w1's waits, then goes once it
  // is answered.
  ASSERT_TRUE(matrix.NextAccessTask("w0", live, now).has_value());
  EXPECT_FALSE(matrix.NextTask("w1", live, now).has_value());  // its sample is fresh
  EXPECT_FALSE(matrix.NextAccessTask("w1", live, now).has_value());
  EXPECT_TRUE(matrix.WantsTask("w1", now));  // asked again at its next heartbeat
  // A measure through a loaded port waits as well.
  now += options.refresh_ms + 1;
  matrix.RecordAccess("w0", AccessMeasured(1e8, 1e8, 2), now - options.refresh_ms);
  ASSERT_TRUE(matrix.NextAccessTask("w1", live, now).has_value());
  EXPECT_FALSE(matrix.NextTask("w2", live, now).has_value());
  matrix.RecordAccess("w1", AccessMeasured(1e8, 1e8, 2), now);
  std::optional<v1::ProbeTask> measure = matrix.NextTask("w2", live, now);
  ASSERT_TRUE(measure.has_value());
  // And an access task waits for another's measure through one of its
  // ports (a worker's own tasks run one after another).
  EXPECT_FALSE(matrix.NextAccessTask("w0", live, now).has_value());
  matrix.RecordProbe("w2", Measured(measure->worker_id(), 0.01, 1e8), now);
  EXPECT_TRUE(matrix.NextAccessTask("w0", live, now).has_value());
  // A task past its timeout loads nothing any more.
  EXPECT_FALSE(matrix.NextAccessTask("w2", live, now).has_value());
  EXPECT_TRUE(matrix.NextAccessTask("w2", live, now + options.task_timeout_ms).has_value());
}

// A failed or implausible answer leaves the port unknown (not limited) and
// is not retried before the refresh; an unanswered task is given up.
TEST(NetworkMatrixTest, AFailedAccessMeasurementLeavesThePortUnknown) {
  NetworkMatrixOptions options;
  options.sample = 2;
  NetworkMatrix matrix(options);
  const std::vector<WorkerRecord> live = Workers(3);
  int64_t now = 1000;
  for (int i = 0; i < 2; ++i) {
    std::optional<v1::ProbeTask> task = matrix.NextTask("w0", live, now);
    ASSERT_TRUE(task.has_value());
    matrix.RecordProbe("w0", Measured(task->worker_id(), 0.01, 1e8), now);
  }
  ASSERT_TRUE(matrix.NextAccessTask("w0", live, now).has_value());
  // Unanswered past the task timeout: asked again.
  now += options.task_timeout_ms + 1;
  ASSERT_TRUE(matrix.NextAccessTask("w0", live, now).has_value());
  v1::AccessProbeResult failed;
  failed.set_detail("w1: no answer");
  matrix.RecordAccess("w0", failed, now);
  ASSERT_TRUE(matrix.AccessOf("w0").has_value());
  EXPECT_EQ(matrix.AccessOf("w0")->uplink_bps, 0);
  EXPECT_TRUE(matrix.AccessSettled("w0", live));
  EXPECT_FALSE(matrix.NextAccessTask("w0", live, now + 1000).has_value());
  std::vector<PlannerWorkerInfo> workers(1);
  workers[0].id = "w0";
  matrix.FillAccess(&workers);
  EXPECT_EQ(workers[0].uplink_bps, 0);
  // Implausible figures count as a failure.
  now += options.refresh_ms + 1;
  ASSERT_TRUE(matrix.NextAccessTask("w0", live, now).has_value());
  matrix.RecordAccess("w0", AccessMeasured(1e15, 1e8, 2), now);
  EXPECT_EQ(matrix.AccessOf("w0")->uplink_bps, 0);
  EXPECT_EQ(matrix.AccessOf("w0")->downlink_bps, 0);
  // With one peer to measure with, nothing is asked and nothing is awaited.
  const std::vector<WorkerRecord> pair = Workers(2);
  NetworkMatrix small(options);
  std::optional<v1::ProbeTask> task = small.NextTask("w0", pair, now);
  ASSERT_TRUE(task.has_value());
  small.RecordProbe("w0", Measured(task->worker_id(), 0.01, 1e8), now);
  EXPECT_FALSE(small.NextAccessTask("w0", pair, now).has_value());
  EXPECT_TRUE(small.AccessSettled("w0", pair));
}

}  // namespace
}  // namespace geotrain
