#include "coordinator/state_store.h"

#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <google/protobuf/text_format.h>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

absl::Status ErrnoError(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace


absl::StatusOr<StateStore> StateStore::Open(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("state_dir ", dir, ": ", error.message()));
  }
  if (access(dir.c_str(), W_OK) != 0) {
    return ErrnoError(absl::StrCat("state_dir ", dir));
  }
  return StateStore(dir);
}

absl::Status StateStore::WritePlan(const v1::Plan& plan) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(plan, &text);
  return WriteFileAtomically(dir_ + "/plan.textproto", text);
}

namespace {
constexpr char kMembersFile[] = "/members.textproto";
constexpr char kProgressFile[] = "/progress.textproto";
constexpr char kJoinedStateFile[] = "/state.textproto";  // before the split
}  // namespace

absl::Status StateStore::WriteMembers(const v1::CoordinatorState& members) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(members, &text);
  return WriteFileAtomically(dir_ + kMembersFile, text);
}

absl::Status StateStore::WriteProgress(const v1::CoordinatorState& progress) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(progress, &text);
  absl::Status written = WriteFileAtomically(dir_ + kProgressFile, text);
  if (written.ok() && access((dir_ + kMembersFile).c_str(), F_OK) == 0) {
    unlink((dir_ + kJoinedStateFile).c_str());  // both parts are durable
  }
  return written;
}

namespace {
template <typename Message>
absl::StatusOr<std::optional<Message>> ReadTextProto(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::optional<Message>();
  std::stringstream text;
  text << in.rdbuf();
  Message message;
  if (!google::protobuf::TextFormat::ParseFromString(text.str(), &message)) {
    return absl::DataLossError(absl::StrCat(path, " does not parse"));
  }
  return std::optional<Message>(std::move(message));
}
}  // namespace

absl::StatusOr<std::optional<v1::Plan>> StateStore::ReadPlan() const {
  return ReadTextProto<v1::Plan>(dir_ + "/plan.textproto");
}

absl::StatusOr<std::optional<v1::CoordinatorState>> StateStore::ReadState() const {
  absl::StatusOr<std::optional<v1::CoordinatorState>> members =
      ReadTextProto<v1::CoordinatorState>(dir_ + kMembersFile);
  if (!members.ok()) return members.status();
  absl::StatusOr<std::optional<v1::CoordinatorState>> progress =
      ReadTextProto<v1::CoordinatorState>(dir_ + kProgressFile);
  if (!progress.ok()) return progress.status();
  if (!members->has_value() || !progress->has_value()) {
    absl::StatusOr<std::optional<v1::CoordinatorState>> joined =
        ReadTextProto<v1::CoordinatorState>(dir_ + kJoinedStateFile);
    if (!joined.ok()) return joined.status();
    if (!members->has_value()) *members = *joined;
    if (!progress->has_value()) *progress = *joined;
  }
  return JoinStateParts(*members, *progress);
}

}  // namespace geotrain
