#include "common/json.h"

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

}  // namespace geotrain
