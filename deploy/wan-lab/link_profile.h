// Named WAN profiles (one-way delay, bandwidth), from DESIGN.md's DT-FM
// scenarios and typical home uplinks.
#ifndef GEOTRAIN_DEPLOY_WAN_LAB_LINK_PROFILE_H_
#define GEOTRAIN_DEPLOY_WAN_LAB_LINK_PROFILE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace geotrain::wanlab {

struct LinkProfile {
  std::string name;
  double delay_ms;
  double rate_mbit;
  std::string description;
};

// Every profile, in a stable order.
const std::vector<LinkProfile>& LinkProfiles();

// The profile called `name`; NotFound names the known ones.
absl::StatusOr<LinkProfile> FindLinkProfile(const std::string& name);

}  // namespace geotrain::wanlab

#endif  // GEOTRAIN_DEPLOY_WAN_LAB_LINK_PROFILE_H_
