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

absl::Status StateStore::WriteState(const v1::CoordinatorState& state) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(state, &text);
  return WriteFileAtomically(dir_ + "/state.textproto", text);
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
  return ReadTextProto<v1::CoordinatorState>(dir_ + "/state.textproto");
}

}  // namespace geotrain
