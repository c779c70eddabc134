// Writing JSON text by hand (log lines, safetensors headers): string
// escaping. Reading JSON goes through protobuf's JSON parser (into
// google.protobuf.Value); WholeNumber reads a count from it. Thread-safe.
#ifndef GEOTRAIN_COMMON_JSON_H_
#define GEOTRAIN_COMMON_JSON_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "google/protobuf/struct.pb.h"

namespace geotrain {

// `s` as the inside of a JSON string: quotes, backslashes and control
// characters escaped; other bytes (UTF-8 included) as they are.
std::string JsonEscape(std::string_view s);

// `s` as a JSON string, quotes included.
std::string JsonString(std::string_view s);

// A JSON number that is a whole number in [0, max] (max at most 2^53, where
// doubles stop being exact), into *out; false for anything else (a string,
// a fraction, a negative, NaN, beyond max), leaving *out as it was.
bool WholeNumber(const google::protobuf::Value& value, uint64_t max, uint64_t* out);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_JSON_H_
