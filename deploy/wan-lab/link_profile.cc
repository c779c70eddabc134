#include "deploy/wan-lab/link_profile.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace geotrain::wanlab {

const std::vector<LinkProfile>& LinkProfiles() {
  static const auto* const profiles = new std::vector<LinkProfile>{
      {"region", 5, 2000, "two zones of one cloud region"},
      {"virginia-ohio", 11, 1120, "us-east-1 to us-east-2"},
      {"us-east-west", 67, 790, "Oregon to Virginia"},
      {"tokyo-london", 210, 366, "Tokyo to London"},
      {"sydney-frankfurt", 265, 328, "Sydney to Frankfurt"},
      {"home-100mbit", 20, 100, "a fast home uplink"},
      {"home-10mbit", 20, 10, "a slow home uplink"},
  };
  return *profiles;
}

absl::StatusOr<LinkProfile> FindLinkProfile(const std::string& name) {
  std::vector<std::string> names;
  for (const LinkProfile& profile : LinkProfiles()) {
    if (profile.name == name) return profile;
    names.push_back(profile.name);
  }
  return absl::NotFoundError(absl::StrCat("unknown profile '", name, "'; known: ",
                                          absl::StrJoin(names, ", ")));
}

}  // namespace geotrain::wanlab
