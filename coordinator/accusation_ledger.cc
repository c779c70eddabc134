#include "coordinator/accusation_ledger.h"

#include "absl/strings/str_cat.h"

namespace geotrain {

absl::Status AccusationLedger::MayAccuse(const std::string& accuser, const std::string& accused,
                                         int64_t now_ms) const {
  if (auto suspected = suspected_.find(accuser); suspected != suspected_.end()) {
    return absl::PermissionDeniedError(absl::StrCat("accusation of ", accused, " by ", accuser,
                                                    " ignored: the accuser is suspected (",
                                                    suspected->second, ")"));
  }
  if (auto last = last_accusation_ms_.find(accuser);
      last != last_accusation_ms_.end() && now_ms - last->second < lease_ms_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("accusation of ", accused, " by ", accuser,
                     " refused: one accusation per worker per lease (", lease_ms_, " ms)"));
  }
  return absl::OkStatus();
}

void AccusationLedger::Record(const std::string& accuser, const std::string& accused,
                              int64_t now_ms) {
  last_accusation_ms_[accuser] = now_ms;
  pending_[accused] = {accuser, now_ms};
}

std::vector<AccusationLedger::Suspicion> AccusationLedger::Review(
    const std::vector<WorkerRecord>& members, int64_t now_ms, bool authenticated_callers) {
  std::map<std::string, const WorkerRecord*> records;
  for (const WorkerRecord& w : members) records[w.id] = &w;
  std::vector<Suspicion> newly;
  for (auto it = pending_.begin(); it != pending_.end();) {
    const auto& [accused, accusation] = *it;
    auto record = records.find(accused);
    if (record == records.end() || !record->second->alive) {
      it = pending_.erase(it);  // confirmed: the accused is gone
      continue;
    }
    if (now_ms - accusation.at_ms < 2 * lease_ms_) {
      ++it;
      continue;
    }
    // The accused kept its lease for two lease periods after the
    // accusation: it was alive, and only its link from the accuser failed.
    if (record->second->last_heartbeat_ms > accusation.at_ms + lease_ms_ &&
        authenticated_callers) {
      const int count = ++unconfirmed_[accusation.accuser];
      if (count >= kUnconfirmedToSuspect && suspected_.count(accusation.accuser) == 0) {
        const std::string why =
            absl::StrCat(count, " of its link_lost accusations were not confirmed: the accused "
                                "kept heartbeating");
        suspected_[accusation.accuser] = why;
        newly.push_back({accusation.accuser, why});
      }
    }
    it = pending_.erase(it);
  }
  return newly;
}

std::optional<std::string> AccusationLedger::SuspicionOf(const std::string& worker_id) const {
  auto it = suspected_.find(worker_id);
  if (it == suspected_.end()) return std::nullopt;
  return it->second;
}

}  // namespace geotrain
