#include "worker/replica_router.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

// Weight of a new latency sample below the average (a higher one replaces
// it outright).
constexpr double kLatencyDecay = 0.2;
// Without new samples the average fades with this time constant, so a
// worker once slow (say, paused for a moment) is tried again rather than
// avoided for good.
constexpr double kLatencyFadeS = 2.0;

}  // namespace

ReplicaRouter::ReplicaRouter(std::vector<Route> routes, std::function<absl::Time()> now)
    : now_(std::move(now)) {
  for (Route& route : routes) routes_.push_back({std::move(route)});
}

int ReplicaRouter::ChooseLocked(absl::Time now) const {
  int best = 0;
  double best_cost = std::numeric_limits<double>::infinity();
  size_t best_outstanding = 0;
  for (int r = 0; r < static_cast<int>(routes_.size()); ++r) {
    const RouteState& route = routes_[r];
    double latency =
        route.latency_s *
        std::exp(-std::max(0.0, absl::ToDoubleSeconds(now - route.last_reply_at)) / kLatencyFadeS);
    if (!route.outstanding.empty()) {
      const absl::Time oldest = std::min_element(route.outstanding.begin(),
                                                 route.outstanding.end(),
                                                 [](const auto& a, const auto& b) {
                                                   return a.second < b.second;
                                                 })->second;
      latency = std::max(latency, absl::ToDoubleSeconds(now - oldest));
    }
    const double cost = (route.outstanding.size() + 1) * latency;
    // Ties (nothing measured yet) go to the least loaded, then the first.
    if (cost < best_cost ||
        (cost == best_cost && route.outstanding.size() < best_outstanding)) {
      best = r;
      best_cost = cost;
      best_outstanding = route.outstanding.size();
    }
  }
  return best;
}

absl::Status ReplicaRouter::SendTo(int route, LinkMessage message) {
  MessageSink* sink;
  {
    absl::MutexLock lock(&mu_);
    sink = routes_[route].route.sink;
  }
  absl::Status sent = sink->Send(std::move(message));
  if (!sent.ok()) {
    absl::MutexLock lock(&mu_);
    failed_peer_ = routes_[route].route.peer_id;
  }
  return sent;
}

absl::Status ReplicaRouter::Send(LinkMessage message) {
  int route = 0;
  switch (message.header.kind()) {
    case v1::MESSAGE_KIND_ACTIVATION: {
      absl::MutexLock lock(&mu_);
      const absl::Time now = now_();
      route = ChooseLocked(now);
      RouteState& chosen = routes_[route];
      ++chosen.sent;
      chosen.outstanding[message.header.microbatch()] = now;
      chosen.sent_end = std::max(chosen.sent_end, message.header.microbatch() + 1);
      route_of_[message.header.microbatch()] = route;
      break;
    }
    case v1::MESSAGE_KIND_EVAL: {
      absl::MutexLock lock(&mu_);
      if (eval_route_ < 0) eval_route_ = ChooseLocked(now_());
      route = eval_route_;
      break;
    }
    case v1::MESSAGE_KIND_EVAL_END: {
      absl::MutexLock lock(&mu_);
      route = eval_route_ >= 0 ? eval_route_ : ChooseLocked(now_());
      eval_route_ = -1;
      break;
    }
    case v1::MESSAGE_KIND_DONE: {
      // Each replica's DONE names the end of what was routed to it (its
      // microbatch field): the router may have sent any run of the last ids
      // to the others.
      std::vector<uint64_t> ends;
      {
        absl::MutexLock lock(&mu_);
        for (const RouteState& r : routes_) ends.push_back(r.sent_end);
      }
      for (size_t r = 0; r < ends.size(); ++r) {
        LinkMessage done = message;  // a copy: DONE has no payload
        done.header.set_microbatch(ends[r]);
        absl::Status sent = SendTo(static_cast<int>(r), std::move(done));
        if (!sent.ok()) return sent;
      }
      return absl::OkStatus();
    }
    default:
      return absl::InternalError(absl::StrCat("the router sends nothing of kind ",
                                              v1::MessageKind_Name(message.header.kind())));
  }
  return SendTo(route, std::move(message));
}

void ReplicaRouter::OnReply(uint64_t microbatch) {
  absl::MutexLock lock(&mu_);
  auto it = route_of_.find(microbatch);
  if (it == route_of_.end()) return;
  RouteState& route = routes_[it->second];
  route_of_.erase(it);
  auto sent = route.outstanding.find(microbatch);
  if (sent == route.outstanding.end()) return;
  const double sample = absl::ToDoubleSeconds(now_() - sent->second);
  route.outstanding.erase(sent);
  route.last_reply_at = now_();
  route.latency_s = sample > route.latency_s || route.latency_s == 0
                        ? sample
                        : (1 - kLatencyDecay) * route.latency_s + kLatencyDecay * sample;
}

std::string ReplicaRouter::oldest_pending_peer() const {
  absl::MutexLock lock(&mu_);
  std::string peer;
  absl::Time oldest = absl::InfiniteFuture();
  for (const RouteState& r : routes_) {
    if (!r.outstanding.empty()) {
      for (const auto& [microbatch, sent_at] : r.outstanding) {
        if (sent_at < oldest) {
          oldest = sent_at;
          peer = r.route.peer_id;
        }
      }
    }
  }
  return peer;
}

std::string ReplicaRouter::failed_peer() const {
  absl::MutexLock lock(&mu_);
  return failed_peer_;
}

std::vector<v1::RouteStats> ReplicaRouter::Stats() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = now_();
  std::vector<v1::RouteStats> stats;
  for (const RouteState& route : routes_) {
    v1::RouteStats& out = stats.emplace_back();
    out.set_peer(route.route.address);
    out.set_sent(route.sent);
    out.set_outstanding(static_cast<int32_t>(route.outstanding.size()));
    out.set_latency_s(route.latency_s);
    double oldest = 0;
    for (const auto& [microbatch, at] : route.outstanding) {
      oldest = std::max(oldest, absl::ToDoubleSeconds(now - at));
    }
    out.set_oldest_outstanding_s(oldest);
  }
  return stats;
}

}  // namespace geotrain
