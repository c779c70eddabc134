#include "coordinator/link_assigner.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/join_token.h"
#include "common/plan_util.h"

namespace geotrain {

namespace {

// Who opens the link from `up` to `down` (see AssignLinks).
void ChooseDialer(const LinkAssignerInput& input, const std::string& up, const std::string& down,
                  std::map<std::string, int>* relay_load, v1::PlannedLink* link) {
  if (input.reachable(down)) {
    link->set_dialer(v1::LINK_DIALER_UPSTREAM);
    return;
  }
  if (input.reachable(up)) {
    link->set_dialer(v1::LINK_DIALER_DOWNSTREAM);
    link->set_reason(absl::StrCat(input.name_of(down), " is not reachable: it dials"));
    return;
  }
  if (input.relays.empty()) {
    link->set_dialer(v1::LINK_DIALER_NONE);
    link->set_reason(absl::StrCat(
        "neither ", input.name_of(up), " nor ", input.name_of(down),
        " is reachable and no relay is live: start geotrain-relay on a reachable host, "
        "or make one of them reachable (forward its port, or set --advertise)"));
    return;
  }
  const WorkerRecord* best = &input.relays[0];
  for (const WorkerRecord& r : input.relays) {
    if ((*relay_load)[r.id] < (*relay_load)[best->id]) best = &r;
  }
  ++(*relay_load)[best->id];
  link->set_dialer(v1::LINK_DIALER_RELAY);
  link->set_relay_worker(best->id);
  link->set_relay_address(best->address);
  link->set_rendezvous(RandomHexSecret(16));
  link->set_upstream_proof(RandomHexSecret(16));
  link->set_downstream_proof(RandomHexSecret(16));
  link->set_reason(absl::StrCat("neither ", input.name_of(up), " nor ", input.name_of(down),
                                " is reachable"));
}

}  // namespace

void AssignLinks(const LinkAssignerInput& input, v1::Plan* plan) {
  plan->clear_links();
  std::map<std::string, int> relay_load;
  for (int k = 0; k + 1 < plan->stages_size(); ++k) {
    for (const StageWorker& up : WorkersOf(plan->stages(k))) {
      for (const StageWorker& down : WorkersOf(plan->stages(k + 1))) {
        if (down.pipeline != up.pipeline) continue;  // links stay in a pipeline
        v1::PlannedLink* link = plan->add_links();
        link->set_upstream_worker(up.id);
        link->set_downstream_worker(down.id);
        ChooseDialer(input, up.id, down.id, &relay_load, link);
      }
    }
  }
  if (PipelinesOf(*plan) < 2) return;
  // The outer sync's star: each stage's replica in pipeline r > 0 to the
  // stage's reducer, its worker in pipeline 0.
  for (int k = 0; k < plan->stages_size(); ++k) {
    const std::vector<StageWorker> workers = WorkersOf(plan->stages(k));
    const StageWorker* reducer = nullptr;
    for (const StageWorker& w : workers) {
      if (w.pipeline == 0 && reducer == nullptr) reducer = &w;
    }
    if (reducer == nullptr) continue;
    for (const StageWorker& w : workers) {
      if (w.pipeline == 0) continue;
      v1::PlannedLink* link = plan->add_links();
      link->set_upstream_worker(w.id);
      link->set_downstream_worker(reducer->id);
      link->set_outer(true);
      ChooseDialer(input, w.id, reducer->id, &relay_load, link);
    }
  }
}

v1::Plan PlanViewFor(const v1::Plan& plan, const std::string& viewer) {
  v1::Plan view = plan;
  for (v1::PlannedLink& link : *view.mutable_links()) {
    if (link.relay_worker() == viewer) continue;
    if (link.upstream_worker() != viewer) link.clear_upstream_proof();
    if (link.downstream_worker() != viewer) link.clear_downstream_proof();
    if (link.upstream_worker() != viewer && link.downstream_worker() != viewer) {
      link.clear_rendezvous();
    }
  }
  return view;
}

}  // namespace geotrain
