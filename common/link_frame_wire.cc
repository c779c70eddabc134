#include "common/link_frame_wire.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

// LinkFrame's fields (stage.proto) and protobuf's wire types.
constexpr uint32_t kHeaderField = 1, kDataField = 2, kLastField = 3;
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// Reads across the pieces of one encoded frame.
class PieceReader {
 public:
  explicit PieceReader(absl::Span<const absl::string_view> pieces) : pieces_(pieces) {
    SkipEmpty();
  }
  bool AtEnd() const { return piece_ == pieces_.size(); }

  bool ReadVarint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (AtEnd()) return false;
      const uint8_t byte = static_cast<uint8_t>(pieces_[piece_][offset_]);
      Advance(1);
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes
  }
  // The next `n` bytes as views into the pieces; false when fewer remain.
  bool Take(uint64_t n, std::vector<absl::string_view>* views) {
    while (n > 0) {
      if (AtEnd()) return false;
      const absl::string_view rest = pieces_[piece_].substr(offset_);
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, rest.size()));
      if (views != nullptr) views->push_back(rest.substr(0, take));
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    if (offset_ == pieces_[piece_].size()) {
      ++piece_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (piece_ < pieces_.size() && pieces_[piece_].empty()) ++piece_;
  }

  absl::Span<const absl::string_view> pieces_;
  size_t piece_ = 0;
  size_t offset_ = 0;
};

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("link frame does not parse: ", what));
}

}  // namespace

std::string FramePrefix(const v1::LinkHeader* header, size_t data_bytes) {
  std::string prefix;
  if (header != nullptr) {
    const std::string encoded = header->SerializeAsString();
    prefix.push_back(static_cast<char>(kHeaderField << 3 | kLengthDelimited));
    AppendVarint(encoded.size(), &prefix);
    prefix += encoded;
  }
  if (data_bytes > 0) {
    prefix.push_back(static_cast<char>(kDataField << 3 | kLengthDelimited));
    AppendVarint(data_bytes, &prefix);
  }
  return prefix;
}

absl::string_view FrameSuffix(bool last) {
  static constexpr char kLast[] = {static_cast<char>(kLastField << 3 | kVarint), 1};
  return last ? absl::string_view(kLast, 2) : absl::string_view();
}

absl::StatusOr<FrameParts> ParseFrame(absl::Span<const absl::string_view> pieces) {
  FrameParts parts;
  PieceReader reader(pieces);
  while (!reader.AtEnd()) {
    uint64_t tag;
    if (!reader.ReadVarint(&tag) || tag > UINT32_MAX) return Malformed("bad field tag");
    const uint32_t field = static_cast<uint32_t>(tag >> 3), type = tag & 7;
    if (field == 0) return Malformed("field number 0");
    switch (type) {
      case kVarint: {
        uint64_t value;
        if (!reader.ReadVarint(&value)) return Malformed("truncated varint");
        if (field == kLastField) parts.last = value != 0;
        break;
      }
      case kFixed64:
      case kFixed32:
        if (!reader.Take(type == kFixed64 ? 8 : 4, nullptr)) return Malformed("truncated field");
        break;
      case kLengthDelimited: {
        uint64_t size;
        if (!reader.ReadVarint(&size)) return Malformed("truncated length");
        std::vector<absl::string_view> views;
        if (!reader.Take(size, &views)) {
          return Malformed(absl::StrCat("field ", field, " of ", size, " bytes runs past the end"));
        }
        if (field == kDataField) {  // the last occurrence wins, as in protobuf
          parts.data = std::move(views);
          parts.data_bytes = static_cast<size_t>(size);
        } else if (field == kHeaderField) {  // occurrences merge, as in protobuf
          std::string encoded;
          encoded.reserve(static_cast<size_t>(size));
          for (absl::string_view v : views) encoded.append(v.data(), v.size());
          if (!parts.header.has_value()) parts.header.emplace();
          if (!parts.header->MergeFromString(encoded)) return Malformed("bad header");
        }
        break;
      }
      default:  // groups (3, 4) and the undefined 6 and 7
        return Malformed(absl::StrCat("wire type ", type, " in field ", field));
    }
  }
  return parts;
}

void PayloadCopyCounters::Reset() {
  tensor_to_payload = 0;
  payload_to_wire = 0;
  wire_to_payload = 0;
  payload_to_tensor = 0;
  staging = 0;
}

PayloadCopyCounters& PayloadCopies() {
  static PayloadCopyCounters* counters = new PayloadCopyCounters();
  return *counters;
}

}  // namespace geotrain
