#include "coordinator/output_norm_watch.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace geotrain {
namespace {

// The stage `worker` serves in `plan` (-1: none), and how many workers
// serve it.
std::pair<int, int> StageOf(const v1::Plan& plan, const std::string& worker) {
  for (const v1::StageAssignment& s : plan.stages()) {
    bool found = s.worker_id() == worker;
    for (const v1::Replica& r : s.replicas()) found = found || r.worker_id() == worker;
    if (found) return {s.stage(), 1 + s.replicas_size()};
  }
  return {-1, 0};
}

// The one worker that sends `receiver` what arrives on its link toward
// `direction`: its upstream neighbour for "upstream" (activations), its
// downstream one for "downstream" (gradients). Empty when the plan names
// none or several (a stage routed to replicas: the figure mixes them).
std::string SenderOf(const v1::Plan& plan, const std::string& receiver,
                     const std::string& direction) {
  std::string sender;
  int found = 0;
  for (const v1::PlannedLink& link : plan.links()) {
    if (link.outer()) continue;
    if (direction == "upstream" && link.downstream_worker() == receiver) {
      sender = link.upstream_worker();
      ++found;
    } else if (direction == "downstream" && link.upstream_worker() == receiver) {
      sender = link.downstream_worker();
      ++found;
    }
  }
  return found == 1 ? sender : "";
}

bool Outside(double value, double reference, double ratio) {
  return reference > 0 && (value > reference * ratio || value * ratio < reference);
}

// What a sender is compared with: the median of the stage's figures
// (`self` included) with three or more, the other one's with two, none
// alone.
double ReplicasReference(double self, std::vector<double> others) {
  if (others.size() <= 1) return others.empty() ? 0 : others[0];
  // The median of them all, itself included, which one outlier cannot move
  // far (the median of the others alone would be the mean of an honest one
  // and the outlier with two others).
  others.push_back(self);
  std::sort(others.begin(), others.end());
  const size_t n = others.size();
  return n % 2 == 1 ? others[n / 2] : (others[n / 2 - 1] + others[n / 2]) / 2;
}

}  // namespace

OutputNormWatch::OutputNormWatch(OutputNormWatchOptions options) : options_(options) {}

std::vector<OutputNorms> OutputNormWatch::Record(const v1::Plan& plan,
                                                 const std::string& receiver,
                                                 uint64_t receiver_epoch,
                                                 const v1::StageStats& stats) {
  std::vector<OutputNorms> changed;
  if (receiver_epoch != plan.epoch()) return changed;
  absl::MutexLock lock(&mu_);
  std::set<Group> touched;
  for (int i = 0; i < std::min(stats.links_size(), 64); ++i) {
    const v1::LinkStats& link = stats.links(i);
    if (link.received_rms_by_step_size() == 0) continue;
    const std::string sender = SenderOf(plan, receiver, link.direction());
    if (sender.empty()) continue;
    const Key key{sender, link.direction() == "upstream" ? "activation" : "gradient"};
    Figure& figure = figures_[key];
    const auto [stage, stage_workers] = StageOf(plan, sender);
    if (stage != figure.stage || plan.epoch() != figure.epoch) {
      // Another plan may cut the model elsewhere: other numbers. Its
      // figures, and its history, start again.
      figure.samples.clear();
      figure.history.clear();
      figure.suspicion.clear();
      figure.judged_step = -1;
    }
    figure.stage = stage;
    figure.stage_workers = stage_workers;
    figure.epoch = plan.epoch();
    figure.receiver = receiver;
    for (int j = 0; j < std::min(link.received_rms_by_step_size(), 64); ++j) {
      const v1::StepRms& sample = link.received_rms_by_step(j);
      if (sample.step() < 0 || sample.messages() == 0 || !std::isfinite(sample.rms()) ||
          sample.rms() < 0) {
        continue;
      }
      figure.samples[sample.step()] = {sample.rms(), sample.messages()};
    }
    while (figure.samples.size() > options_.kept_samples) {
      figure.samples.erase(figure.samples.begin());
    }
    if (stage >= 0 && !figure.samples.empty()) touched.insert({key.second, stage, plan.epoch()});
  }
  for (const Group& group : touched) JudgeGroupLocked(group, &changed);
  return changed;
}

void OutputNormWatch::JudgeGroupLocked(const Group& group, std::vector<OutputNorms>* changed) {
  const auto& [kind, stage, epoch] = group;
  std::vector<std::pair<const Key*, Figure*>> members;
  for (auto& [key, figure] : figures_) {
    if (key.second == kind && figure.stage == stage && figure.epoch == epoch) {
      members.push_back({&key, &figure});
    }
  }
  // Until every worker of the stage has figures, none is judged: with
  // three pipelines, the first two would be taken for a pair, and an
  // honest one made a suspect beside an outlier.
  if (members.empty() || static_cast<int>(members.size()) < members[0].second->stage_workers) {
    return;
  }
  // The newest step all of them have, later than the last judged.
  int& last_judged = judged_steps_.try_emplace(group, -1).first->second;
  int step = -1;
  for (auto it = members[0].second->samples.rbegin(); it != members[0].second->samples.rend();
       ++it) {
    if (it->first <= last_judged) break;
    bool everyone = true;
    for (const auto& member : members) everyone = everyone && member.second->samples.count(it->first);
    if (everyone) {
      step = it->first;
      break;
    }
  }
  if (step < 0) return;
  last_judged = step;
  std::vector<std::string> figures;
  for (const auto& [key, figure] : members) {
    const Sample& sample = figure->samples.at(step);
    figures.push_back(absl::StrFormat("%s %.4g (by %s over %d)", key->first, sample.rms,
                                      figure->receiver, sample.messages));
  }
  const std::string at = absl::StrFormat("step %d, plan epoch %d: %s", step, epoch,
                                         absl::StrJoin(figures, ", "));
  for (const auto& [key, figure] : members) {
    const double rms = figure->samples.at(step).rms;
    std::vector<double> others;
    for (const auto& other : members) {
      if (other.second != figure) others.push_back(other.second->samples.at(step).rms);
    }
    const double reference = ReplicasReference(rms, others);
    std::string suspicion;
    if (Outside(rms, reference, options_.replica_ratio)) {
      suspicion = absl::StrFormat("its %ss (stage %d) measure %.3gx the median of its replicas' (%s)",
                                  kind, stage, rms / reference, at);
    } else if (figure->history.size() >= options_.min_history) {
      const auto [low, high] = std::minmax_element(figure->history.begin(), figure->history.end());
      if (rms > *high * options_.history_ratio) {
        suspicion = absl::StrFormat("its %ss (stage %d) jumped to %.3gx the largest of their "
                                    "last %d figures (step %d)",
                                    kind, stage, rms / *high,
                                    static_cast<int>(figure->history.size()), step);
      } else if (rms * options_.history_ratio < *low) {
        suspicion = absl::StrFormat("its %ss (stage %d) fell to %.3gx the smallest of their "
                                    "last %d figures (step %d)",
                                    kind, stage, rms / *low,
                                    static_cast<int>(figure->history.size()), step);
      }
    }
    figure->judged_step = step;
    figure->judged_rms = rms;
    figure->judged_replicas_rms = reference;
    // The history learns only from figures that raised no suspicion, so an
    // outlier cannot teach it its lie.
    if (suspicion.empty()) {
      figure->history.push_back(rms);
      while (figure->history.size() > options_.history_window) figure->history.pop_front();
    }
    const bool was = !figure->suspicion.empty();
    figure->suspicion = suspicion;
    if (was != !suspicion.empty()) changed->push_back(NormsLocked(*key, *figure));
  }
}

OutputNorms OutputNormWatch::NormsLocked(const Key& key, const Figure& figure) const {
  OutputNorms norms;
  norms.worker_id = key.first;
  norms.kind = key.second;
  norms.stage = figure.stage;
  norms.step = figure.judged_step;
  norms.rms = figure.judged_step >= 0 || figure.samples.empty()
                  ? figure.judged_rms
                  : figure.samples.rbegin()->second.rms;
  norms.replicas_rms = figure.judged_replicas_rms;
  if (figure.history.size() >= options_.min_history) {
    double sum = 0;
    for (double h : figure.history) sum += h;
    norms.history_rms = sum / figure.history.size();
  }
  norms.suspicion = figure.suspicion;
  return norms;
}

std::vector<OutputNorms> OutputNormWatch::NormsOf(const std::string& worker_id) const {
  std::vector<OutputNorms> out;
  absl::MutexLock lock(&mu_);
  for (auto it = figures_.lower_bound(Key{worker_id, ""});
       it != figures_.end() && it->first.first == worker_id; ++it) {
    out.push_back(NormsLocked(it->first, it->second));
  }
  return out;
}

std::string OutputNormWatch::SuspicionOf(const std::string& worker_id) const {
  std::vector<std::string> reasons;
  absl::MutexLock lock(&mu_);
  for (auto it = figures_.lower_bound(Key{worker_id, ""});
       it != figures_.end() && it->first.first == worker_id; ++it) {
    if (!it->second.suspicion.empty()) reasons.push_back(it->second.suspicion);
  }
  return absl::StrJoin(reasons, "; ");
}

void OutputNormWatch::Forget(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  figures_.erase(figures_.lower_bound(Key{worker_id, ""}),
                 figures_.lower_bound(Key{worker_id + '\0', ""}));
}

}  // namespace geotrain
