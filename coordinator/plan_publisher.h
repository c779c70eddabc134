// Makes each plan the controller decides visible to the workers, and only
// once it is durable. The controller hands a plan over (Submit, which never
// waits on the store) and goes on; the publisher's thread first runs
// `before_write` (the state the plan depends on, such as the members it
// names, reaches the store first), writes the plan through the store, and
// only then makes it the visible plan, wakes the watchers and calls the
// listeners. No lock of the controller is held for any of it.
//
// Latest wins: a plan submitted while another is being written replaces
// any not yet started, so a slow store costs the workers a plan they would
// have left at once, never a queue. A failed write is retried with backoff
// until it succeeds or a newer plan replaces it; the workers meanwhile keep
// the plan they have.
//
// Thread-safe.
#ifndef GEOTRAIN_COORDINATOR_PLAN_PUBLISHER_H_
#define GEOTRAIN_COORDINATOR_PLAN_PUBLISHER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/coordinator_store.h"
#include "geotrain/v1/coordinator.pb.h"

namespace geotrain {

struct PlanPublisherOptions {
  CoordinatorStore* store = nullptr;  // not owned; required
  // Runs on the publisher's thread before each plan's write. Empty: none.
  std::function<void()> before_write;
  // Backoff between attempts to write a plan the store refused.
  absl::Duration retry_initial = absl::Milliseconds(100);
  absl::Duration retry_max = absl::Seconds(5);
};

class PlanPublisher {
 public:
  using PlanPtr = std::shared_ptr<const v1::Plan>;
  // Runs on the publisher's thread, after the plan became visible, with no
  // lock of the publisher held. It must not block for long: the next plan
  // waits for it.
  using Listener = std::function<void(const PlanPtr&)>;

  explicit PlanPublisher(PlanPublisherOptions options);
  // Stops: a write in progress finishes (a pending plan is written once
  // and, if that succeeds, made visible), then the thread ends.
  ~PlanPublisher();
  PlanPublisher(const PlanPublisher&) = delete;
  PlanPublisher& operator=(const PlanPublisher&) = delete;

  // A recovered coordinator's plan, read from the store (durable already):
  // visible at once, without a write. Call before the first Submit.
  void Restore(v1::Plan plan);
  // Takes the plan and returns; it becomes visible once written.
  void Submit(v1::Plan plan);
  // Called for each plan made visible from now on.
  void AddListener(Listener listener);

  // The newest visible plan; null before the first.
  PlanPtr Visible() const;
  // Blocks until a plan with an epoch above `after_epoch` is visible, the
  // publisher shuts down or `timeout` passes; returns the newest visible
  // plan when its epoch is above `after_epoch`, else null.
  PlanPtr WaitForNewer(uint64_t after_epoch, absl::Duration timeout) const;
  // Waits until every plan submitted before the call is visible or was
  // replaced by a newer one (which is then visible). For shutdown and
  // tests; it waits as long as the store refuses the write.
  void Flush();
  // Wakes every WaitForNewer caller, and later ones return at once; the
  // thread stops retrying.
  void Shutdown();

  // Plans made visible, plans replaced before their write, and refused
  // writes (each retry counts).
  int64_t published() const;
  int64_t superseded() const;
  int64_t write_failures() const;

 private:
  void Run();

  const PlanPublisherOptions options_;
  mutable absl::Mutex mu_;
  mutable absl::CondVar changed_;  // a submit, a publication, or stopping
  std::optional<v1::Plan> pending_ ABSL_GUARDED_BY(mu_);
  int64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;  // sequence of the newest submit
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;       // sequence of the newest visible
  int64_t writing_ ABSL_GUARDED_BY(mu_) = 0;    // sequence being written; 0: none
  PlanPtr visible_ ABSL_GUARDED_BY(mu_);
  std::vector<Listener> listeners_ ABSL_GUARDED_BY(mu_);
  int64_t published_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t superseded_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t write_failures_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_PLAN_PUBLISHER_H_
