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

absl::Status WriteAll(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(absl::StrCat("write ", path));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path,
                                 const std::string& contents) {
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return ErrnoError(absl::StrCat("open ", tmp));
  absl::Status written = WriteAll(fd, contents, tmp);
  if (written.ok() && fsync(fd) != 0) written = ErrnoError("fsync " + tmp);
  close(fd);
  if (!written.ok()) return written;
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return ErrnoError(absl::StrCat("rename ", tmp, " -> ", path));
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dir_fd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
  return absl::OkStatus();
}

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

absl::Status StateStore::AppendEvent(const std::string& line) {
  const std::string path = dir_ + "/events.log";
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) return ErrnoError(absl::StrCat("open ", path));
  absl::Status status = WriteAll(fd, line + "\n", path);
  close(fd);
  return status;
}

}  // namespace geotrain
