// Hugging Face's safetensors format, read and written without LibTorch:
// 8 bytes of little-endian header length N, N bytes of JSON, then the data.
// The JSON maps each tensor's name to {"dtype": "F32", "shape": [...],
// "data_offsets": [begin, end]} (offsets relative to the data's start), and
// may hold "__metadata__": {string: string}.
//
// Files come from strangers: ParseSafetensorsHeader checks everything the
// format promises before anything is read through it, and every error names
// the file.
#ifndef GEOTRAIN_COMMON_SAFETENSORS_H_
#define GEOTRAIN_COMMON_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/files.h"

namespace geotrain {

// Header bigger than this is refused (the format's own reader caps it at
// 100 MB).
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// Bytes per element of a safetensors dtype ("F32", "F16", "BF16", "F64",
// "I64", "I32", "I16", "I8", "U8", "BOOL"); 0 for any other.
size_t SafetensorsDtypeSize(std::string_view dtype);

struct SafetensorsTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // within the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;  // by offset
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + N: where the data section begins in the file
};

// Parses and checks the header of a file of `file_size` bytes whose first
// bytes are `prefix` (at least the 8-byte length and the header; more is
// ignored). INVALID_ARGUMENT naming `source` when: the length field or the
// header does not fit in the file or exceeds kMaxSafetensorsHeaderBytes;
// the header is not a JSON object; an entry lacks a field, has an unknown
// dtype, a negative or non-integral dimension or offset, or a size other
// than its elements x the dtype's size; an entry reaches past the file's
// end; two entries overlap; a name is empty; __metadata__ is not
// string -> string.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view prefix,
                                                         uint64_t file_size,
                                                         std::string_view source);

// A safetensors file mapped read-only; tensors are views into the mapping.
class SafetensorsReader {
 public:
  static absl::StatusOr<SafetensorsReader> Open(const std::string& path);

  const SafetensorsHeader& header() const { return header_; }
  const std::string& path() const { return file_.path(); }
  // nullptr when there is no such tensor.
  const SafetensorsTensor* Find(std::string_view name) const;
  // The tensor's bytes (little-endian elements).
  std::string_view Data(const SafetensorsTensor& tensor) const;

 private:
  SafetensorsReader(MappedFile file, SafetensorsHeader header)
      : file_(std::move(file)), header_(std::move(header)) {}
  MappedFile file_;
  SafetensorsHeader header_;
};

// A tensor's name, dtype ("F32", "F16", "BF16", ...) and shape.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};

// Its size in the file; INVALID_ARGUMENT for an unknown dtype or a
// negative dimension.
absl::StatusOr<uint64_t> SafetensorsBytes(const SafetensorsEntry& entry);

// The first 8 + N bytes of a file holding `tensors` in the order given,
// each taking SafetensorsBytes: for writers that stream the data after it
// (export). INVALID_ARGUMENT for a bad entry or a name that is empty or
// repeats.
absl::StatusOr<std::string> EncodeSafetensorsHeader(
    const std::vector<SafetensorsEntry>& tensors,
    const std::map<std::string, std::string>& metadata);

struct SafetensorsBlob {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string_view data;  // elements x dtype size bytes; not owned
};

// The first 8 + N bytes of a file holding `tensors` in the order given (the
// JSON padded with spaces to a multiple of 8, as the format's writer does).
// INVALID_ARGUMENT when a blob's size does not match its dtype and shape, a
// dtype is unknown, or a name is empty or repeats.
absl::StatusOr<std::string> EncodeSafetensorsHeader(
    const std::vector<SafetensorsBlob>& tensors,
    const std::map<std::string, std::string>& metadata);

// Writes the file: the header, then each blob straight from its view (no
// copy of the whole), to a temporary file that is fsynced and renamed.
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsBlob>& tensors,
                              const std::map<std::string, std::string>& metadata);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_SAFETENSORS_H_
