// Splits a fuzzer's input into pieces: each piece is a 2-byte little-endian
// length and that many bytes (cut short at the end of the input). Lets one
// input carry several protos or a header and a payload.
#ifndef GEOTRAIN_TESTS_FUZZ_FUZZ_INPUT_H_
#define GEOTRAIN_TESTS_FUZZ_FUZZ_INPUT_H_

#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace geotrain {

// Protobuf logs every string field that is not UTF-8 at ERROR; fuzz inputs
// are full of them, and the noise would hide a real report.
inline const bool kQuietProtobuf = (google::protobuf::SetLogHandler(nullptr), true);

inline std::vector<std::string> SplitFuzzInput(const uint8_t* data, size_t size,
                                               size_t max_pieces = 64) {
  std::vector<std::string> pieces;
  size_t at = 0;
  while (at + 2 <= size && pieces.size() < max_pieces) {
    const size_t length = data[at] | (static_cast<size_t>(data[at + 1]) << 8);
    at += 2;
    const size_t n = std::min(length, size - at);
    pieces.emplace_back(reinterpret_cast<const char*>(data + at), n);
    at += n;
  }
  return pieces;
}

}  // namespace geotrain

#endif  // GEOTRAIN_TESTS_FUZZ_FUZZ_INPUT_H_
