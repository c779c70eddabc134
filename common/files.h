// Small file helpers shared by the daemons. Thread-compatible.
#ifndef GEOTRAIN_COMMON_FILES_H_
#define GEOTRAIN_COMMON_FILES_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geotrain {

// Writes `contents` to `path` so that readers see the old or the new file,
// never a torn one: temp file, fsync, rename, fsync of the directory. The
// file gets `mode` (0600 for keys and credentials) from its creation on.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents,
                                 mode_t mode = 0644);

// Writes all of `data` to `fd`, retrying short writes and EINTR.
// UNAVAILABLE naming `path` (for the message only) and errno otherwise.
absl::Status WriteAll(int fd, std::string_view data, const std::string& path);

// Appends `data` (O_APPEND: whole lines from concurrent writers stay whole).
absl::Status AppendToFile(const std::string& path, const std::string& data);

// The whole of a regular file, refused (INVALID_ARGUMENT) without reading
// it when it is larger than `max_bytes` or not a regular file (/dev/zero, a
// FIFO). NOT_FOUND when it cannot be opened.
absl::StatusOr<std::string> ReadFileBounded(const std::string& path, uint64_t max_bytes);

// A regular file mapped read-only (model weights, token files: read in
// place, never copied whole). Movable; unmaps when destroyed. NOT_FOUND
// when the file cannot be opened, INVALID_ARGUMENT when it is not a
// regular file. An empty file maps to an empty view.
class MappedFile {
 public:
  static absl::StatusOr<MappedFile> Open(const std::string& path);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, uint64_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_FILES_H_
