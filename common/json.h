// Writing JSON text by hand (log lines, safetensors headers): string
// escaping. Reading JSON goes through protobuf's JSON parser. Thread-safe.
#ifndef GEOTRAIN_COMMON_JSON_H_
#define GEOTRAIN_COMMON_JSON_H_

#include <string>
#include <string_view>

namespace geotrain {

// `s` as the inside of a JSON string: quotes, backslashes and control
// characters escaped; other bytes (UTF-8 included) as they are.
std::string JsonEscape(std::string_view s);

// `s` as a JSON string, quotes included.
std::string JsonString(std::string_view s);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_JSON_H_
