#include "coordinator/state_sources.h"

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace geotrain {
namespace {

using Place = std::tuple<int, int, int, int>;  // stage, stages, layer_begin, layer_end

// Worker id -> the place it holds in `plan`, with its address.
std::map<std::string, std::pair<Place, std::string>> Holders(const v1::Plan& plan) {
  std::map<std::string, std::pair<Place, std::string>> held;
  for (const v1::StageAssignment& s : plan.stages()) {
    const Place place{s.stage(), plan.stages_size(), s.layer_begin(), s.layer_end()};
    held[s.worker_id()] = {place, s.address()};
    for (const v1::Replica& r : s.replicas()) held[r.worker_id()] = {place, r.address()};
  }
  return held;
}

}  // namespace

void AssignStateSources(const v1::Plan* previous, v1::Plan* next) {
  const auto before = previous != nullptr ? Holders(*previous)
                                          : std::map<std::string, std::pair<Place, std::string>>();
  std::set<int> formed_anew;  // pipelines whose newcomers restore the checkpoint
  for (const v1::PipelineInfo& info : next->pipeline_info()) {
    if (info.formed_epoch() == next->epoch()) formed_anew.insert(info.pipeline());
  }
  for (v1::StageAssignment& s : *next->mutable_stages()) {
    s.clear_state_source();
    const Place place{s.stage(), next->stages_size(), s.layer_begin(), s.layer_end()};
    struct Worker {
      std::string id, address;
      int pipeline = 0;
    };
    std::vector<Worker> workers = {{s.worker_id(), s.address(), 0}};
    for (const v1::Replica& r : s.replicas()) {
      workers.push_back({r.worker_id(), r.address(), r.pipeline()});
    }
    const Worker* holder = nullptr;
    std::vector<std::string> newcomers;
    for (const Worker& worker : workers) {
      auto it = before.find(worker.id);
      if (it != before.end() && it->second.first == place) {
        // Later holders are replicas: the last one found is preferred.
        holder = &worker;
      } else if (formed_anew.count(worker.pipeline) == 0) {
        newcomers.push_back(worker.id);
      }
    }
    if (holder == nullptr || newcomers.empty()) continue;
    v1::StateSource* source = s.mutable_state_source();
    source->set_worker_id(holder->id);
    source->set_address(holder->address);
    for (const std::string& id : newcomers) source->add_for_workers(id);
  }
}

}  // namespace geotrain
