#include "coordinator/output_norm_watch.h"

#include <algorithm>
#include <cmath>

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

}  // namespace

OutputNormWatch::OutputNormWatch(OutputNormWatchOptions options) : options_(options) {}

std::vector<OutputNorms> OutputNormWatch::Record(const v1::Plan& plan,
                                                 const std::string& receiver,
                                                 const v1::StageStats& stats) {
  std::vector<OutputNorms> changed;
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < std::min(stats.links_size(), 64); ++i) {
    const v1::LinkStats& link = stats.links(i);
    if (link.received_measured() < options_.min_messages || !std::isfinite(link.received_rms()) ||
        link.received_rms() < 0) {
      continue;
    }
    const std::string sender = SenderOf(plan, receiver, link.direction());
    if (sender.empty()) continue;
    const Key key{sender, link.direction() == "upstream" ? "activation" : "gradient"};
    Figure& figure = figures_[key];
    const auto [stage, stage_workers] = StageOf(plan, sender);
    if (stage != figure.stage) {
      // Another stage computes other numbers: its history starts again.
      figure.history.clear();
      figure.suspicion.clear();
    }
    figure.stage = stage;
    figure.stage_workers = stage_workers;
    figure.epoch = plan.epoch();
    figure.rms = link.received_rms();
    if (std::optional<OutputNorms> change = JudgeLocked(key)) changed.push_back(*change);
    // The history learns only from figures that raised no suspicion, so an
    // outlier cannot teach it its lie.
    Figure& judged = figures_[key];
    if (judged.suspicion.empty()) {
      judged.history.push_back(judged.rms);
      while (judged.history.size() > options_.history_window) judged.history.pop_front();
    }
  }
  return changed;
}

double OutputNormWatch::ReplicasMedianLocked(const Key& key, int stage) const {
  if (stage < 0) return 0;
  std::vector<double> all;
  double self = 0;
  int stage_workers = 0;
  const uint64_t epoch = figures_.at(key).epoch;
  for (const auto& [other, figure] : figures_) {
    // Figures of the same plan only: a worker the plan has moved or
    // dropped keeps its old figure until it reports again.
    if (other.second != key.second || figure.stage != stage || figure.epoch != epoch) continue;
    if (other.first == key.first) {
      self = figure.rms;
      stage_workers = figure.stage_workers;
    } else {
      all.push_back(figure.rms);
    }
  }
  // Until every worker of the stage has a figure, none is judged against
  // the others: with three pipelines, the first two figures would be taken
  // for a pair, and an honest one made a suspect beside an outlier.
  if (static_cast<int>(all.size()) + 1 < stage_workers) return 0;
  if (all.size() <= 1) return all.empty() ? 0 : all[0];  // none, or the pair's other
  // Three or more: the median of them all, itself included, which one
  // outlier cannot move far (the median of the others alone would be the
  // mean of an honest one and the outlier with two others).
  all.push_back(self);
  std::sort(all.begin(), all.end());
  const size_t n = all.size();
  return n % 2 == 1 ? all[n / 2] : (all[n / 2 - 1] + all[n / 2]) / 2;
}

OutputNorms OutputNormWatch::NormsLocked(const Key& key, const Figure& figure) const {
  OutputNorms norms;
  norms.worker_id = key.first;
  norms.kind = key.second;
  norms.stage = figure.stage;
  norms.rms = figure.rms;
  norms.replicas_rms = ReplicasMedianLocked(key, figure.stage);
  if (figure.history.size() >= options_.min_history) {
    double sum = 0;
    for (double h : figure.history) sum += h;
    norms.history_rms = sum / figure.history.size();
  }
  norms.suspicion = figure.suspicion;
  return norms;
}

std::optional<OutputNorms> OutputNormWatch::JudgeLocked(const Key& key) {
  Figure& figure = figures_[key];
  OutputNorms norms = NormsLocked(key, figure);
  std::string suspicion;
  if (Outside(norms.rms, norms.replicas_rms, options_.replica_ratio)) {
    suspicion = absl::StrFormat("its %ss (stage %d) measure %.3gx the median of its replicas'",
                                key.second, figure.stage, norms.rms / norms.replicas_rms);
  } else if (figure.history.size() >= options_.min_history) {
    const auto [low, high] = std::minmax_element(figure.history.begin(), figure.history.end());
    if (norms.rms > *high * options_.history_ratio) {
      suspicion = absl::StrFormat("its %ss (stage %d) jumped to %.3gx the largest of their "
                                  "last %d figures",
                                  key.second, figure.stage, norms.rms / *high,
                                  static_cast<int>(figure.history.size()));
    } else if (norms.rms * options_.history_ratio < *low) {
      suspicion = absl::StrFormat("its %ss (stage %d) fell to %.3gx the smallest of their "
                                  "last %d figures",
                                  key.second, figure.stage, norms.rms / *low,
                                  static_cast<int>(figure.history.size()));
    }
  }
  const bool was = !figure.suspicion.empty();
  figure.suspicion = suspicion;
  if (was == !suspicion.empty()) return std::nullopt;
  norms.suspicion = suspicion;
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
