#include "common/json.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace geotrain {

std::string JsonEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out;
}

std::string JsonString(std::string_view s) { return "\"" + JsonEscape(s) + "\""; }

bool WholeNumber(const google::protobuf::Value& value, uint64_t max, uint64_t* out) {
  if (value.kind_case() != google::protobuf::Value::kNumberValue) return false;
  const double d = value.number_value();
  const double limit = static_cast<double>(std::min<uint64_t>(max, uint64_t{1} << 53));
  if (!(d >= 0) || d > limit || std::floor(d) != d) return false;
  *out = static_cast<uint64_t>(d);
  return true;
}

}  // namespace geotrain
