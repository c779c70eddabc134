#include "common/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/json.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace geotrain {
namespace {

absl::Status Bad(std::string_view source, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(source), ": not a valid safetensors file: ", std::string(what)));
}

// A JSON number that is a whole number in [0, 2^53].
bool AsUint(const google::protobuf::Value& value, uint64_t* out) {
  return WholeNumber(value, uint64_t{1} << 53, out);
}

}  // namespace

size_t SafetensorsDtypeSize(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view prefix,
                                                         uint64_t file_size,
                                                         std::string_view source) {
  if (prefix.size() < 8 || file_size < 8) return Bad(source, "shorter than its 8-byte header length");
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(prefix[i]);
  if (length > kMaxSafetensorsHeaderBytes) {
    return Bad(source, absl::StrCat("header length ", length, " exceeds the ",
                                    kMaxSafetensorsHeaderBytes, "-byte limit"));
  }
  if (length > file_size - 8) {
    return Bad(source, absl::StrCat("header length ", length, " runs past the file's ",
                                    file_size, " bytes"));
  }
  if (length > prefix.size() - 8) return Bad(source, "header not read in full");
  const std::string json(prefix.substr(8, length));
  google::protobuf::Struct root;
  google::protobuf::util::JsonParseOptions options;
  if (!google::protobuf::util::JsonStringToMessage(json, &root, options).ok()) {
    return Bad(source, "the header is not a JSON object");
  }
  SafetensorsHeader header;
  header.data_start = 8 + length;
  const uint64_t data_size = file_size - header.data_start;
  for (const auto& [name, value] : root.fields()) {
    if (name == "__metadata__") {
      if (value.kind_case() != google::protobuf::Value::kStructValue) {
        return Bad(source, "__metadata__ is not an object");
      }
      for (const auto& [key, item] : value.struct_value().fields()) {
        if (item.kind_case() != google::protobuf::Value::kStringValue) {
          return Bad(source, absl::StrCat("__metadata__[\"", key, "\"] is not a string"));
        }
        header.metadata[key] = item.string_value();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor \"", name.substr(0, 200), "\"");
    if (name.empty()) return Bad(source, "a tensor has an empty name");
    if (value.kind_case() != google::protobuf::Value::kStructValue) {
      return Bad(source, absl::StrCat(where, " is not an object"));
    }
    const auto& fields = value.struct_value().fields();
    auto dtype = fields.find("dtype");
    auto shape = fields.find("shape");
    auto offsets = fields.find("data_offsets");
    if (dtype == fields.end() || shape == fields.end() || offsets == fields.end()) {
      return Bad(source, absl::StrCat(where, " lacks dtype, shape or data_offsets"));
    }
    SafetensorsTensor tensor;
    tensor.name = name;
    if (dtype->second.kind_case() != google::protobuf::Value::kStringValue ||
        SafetensorsDtypeSize(dtype->second.string_value()) == 0) {
      return Bad(source, absl::StrCat(where, " has an unknown dtype"));
    }
    tensor.dtype = dtype->second.string_value();
    if (shape->second.kind_case() != google::protobuf::Value::kListValue ||
        shape->second.list_value().values_size() > 16) {
      return Bad(source, absl::StrCat(where, ": shape is not a list of at most 16 dimensions"));
    }
    // Elements, bounded as we go so that the product cannot overflow.
    uint64_t elements = 1;
    for (const google::protobuf::Value& d : shape->second.list_value().values()) {
      uint64_t dim = 0;
      if (!AsUint(d, &dim)) return Bad(source, absl::StrCat(where, " has a bad dimension"));
      tensor.shape.push_back(static_cast<int64_t>(dim));
      if (dim != 0 && elements > file_size / dim) elements = file_size + 1;  // too big anyway
      else elements *= dim;
    }
    if (offsets->second.kind_case() != google::protobuf::Value::kListValue ||
        offsets->second.list_value().values_size() != 2 ||
        !AsUint(offsets->second.list_value().values(0), &tensor.begin) ||
        !AsUint(offsets->second.list_value().values(1), &tensor.end) ||
        tensor.end < tensor.begin) {
      return Bad(source, absl::StrCat(where, ": data_offsets is not [begin, end]"));
    }
    if (tensor.end > data_size) {
      return Bad(source, absl::StrCat(where, " ends at byte ", tensor.end, " of a ", data_size,
                                      "-byte data section (the file is truncated?)"));
    }
    const uint64_t expected = elements * SafetensorsDtypeSize(tensor.dtype);
    if (elements > file_size || expected != tensor.end - tensor.begin) {
      return Bad(source, absl::StrCat(where, " has ", tensor.end - tensor.begin,
                                      " bytes for its shape and dtype ", tensor.dtype));
    }
    header.tensors.push_back(std::move(tensor));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  for (size_t i = 1; i < header.tensors.size(); ++i) {
    const SafetensorsTensor& a = header.tensors[i - 1];
    const SafetensorsTensor& b = header.tensors[i];
    if (b.begin < a.end) {
      return Bad(source, absl::StrCat("tensors \"", a.name.substr(0, 200), "\" and \"",
                                      b.name.substr(0, 200), "\" overlap"));
    }
  }
  return header;
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::Open(const std::string& path) {
  absl::StatusOr<MappedFile> file = MappedFile::Open(path);
  if (!file.ok()) return file.status();
  const std::string_view bytes(reinterpret_cast<const char*>(file->data()), file->size());
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensorsHeader(bytes, file->size(), path);
  if (!header.ok()) return header.status();
  return SafetensorsReader(*std::move(file), *std::move(header));
}

const SafetensorsTensor* SafetensorsReader::Find(std::string_view name) const {
  for (const SafetensorsTensor& t : header_.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::string_view SafetensorsReader::Data(const SafetensorsTensor& tensor) const {
  return std::string_view(reinterpret_cast<const char*>(file_.data()) + header_.data_start +
                              tensor.begin,
                          tensor.end - tensor.begin);
}

absl::StatusOr<uint64_t> SafetensorsBytes(const SafetensorsEntry& entry) {
  const size_t size = SafetensorsDtypeSize(entry.dtype);
  if (size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(entry.name, ": unknown dtype ", entry.dtype));
  }
  uint64_t elements = 1;
  for (int64_t d : entry.shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat(entry.name, ": negative dimension"));
    elements *= static_cast<uint64_t>(d);
  }
  return elements * size;
}

absl::StatusOr<std::string> EncodeSafetensorsHeader(
    const std::vector<SafetensorsEntry>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  if (!metadata.empty()) {
    absl::StrAppend(&json, "\"__metadata__\":{");
    bool first = true;
    for (const auto& [key, value] : metadata) {
      absl::StrAppend(&json, first ? "" : ",", JsonString(key), ":", JsonString(value));
      first = false;
    }
    absl::StrAppend(&json, "}");
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const SafetensorsEntry& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor name \"", t.name, "\" empty or repeated"));
    }
    absl::StatusOr<uint64_t> bytes = SafetensorsBytes(t);
    if (!bytes.ok()) return bytes.status();
    std::string shape;
    for (int64_t d : t.shape) absl::StrAppend(&shape, shape.empty() ? "" : ",", d);
    absl::StrAppend(&json, json.size() > 1 ? "," : "", JsonString(t.name), ":{\"dtype\":\"",
                    t.dtype, "\",\"shape\":[", shape, "],\"data_offsets\":[", offset, ",",
                    offset + *bytes, "]}");
    offset += *bytes;
  }
  json += "}";
  while ((8 + json.size()) % 8 != 0) json += ' ';
  std::string out(8, '\0');
  uint64_t length = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out + json;
}

absl::StatusOr<std::string> EncodeSafetensorsHeader(
    const std::vector<SafetensorsBlob>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  for (const SafetensorsBlob& t : tensors) {
    SafetensorsEntry entry{t.name, t.dtype, t.shape};
    absl::StatusOr<uint64_t> bytes = SafetensorsBytes(entry);
    if (!bytes.ok()) return bytes.status();
    if (*bytes != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat(t.name, ": ", t.data.size(), " bytes for ",
                                                     *bytes, " bytes of ", t.dtype));
    }
    entries.push_back(std::move(entry));
  }
  return EncodeSafetensorsHeader(entries, metadata);
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsBlob>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> header = EncodeSafetensorsHeader(tensors, metadata);
  if (!header.ok()) return header.status();
  const std::string temp = path + ".tmp";
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot write ", temp, ": ", std::strerror(errno)));
  }
  absl::Status written = WriteAll(fd, *header, temp);
  for (const SafetensorsBlob& t : tensors) {
    if (written.ok()) written = WriteAll(fd, t.data, temp);
  }
  if (written.ok() && fsync(fd) != 0) {
    written = absl::UnavailableError(absl::StrCat("fsync ", temp, ": ", std::strerror(errno)));
  }
  close(fd);
  if (written.ok() && rename(temp.c_str(), path.c_str()) != 0) {
    written = absl::UnavailableError(
        absl::StrCat("rename ", temp, " -> ", path, ": ", std::strerror(errno)));
  }
  if (!written.ok()) {
    unlink(temp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", written.message()));
  }
  return absl::OkStatus();
}

}  // namespace geotrain
