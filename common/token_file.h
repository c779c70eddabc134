// Pre-tokenized data, nanoGPT's train.bin/val.bin: a flat array of
// little-endian token ids (uint16 or uint32), memory-mapped and read in
// place. Torch-free. Thread-compatible (read-only after Open).
#ifndef GEOTRAIN_COMMON_TOKEN_FILE_H_
#define GEOTRAIN_COMMON_TOKEN_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/files.h"

namespace geotrain {

class TokenFile {
 public:
  // `bytes_per_token`: 2 or 4. Checks the whole file at once, so that a bad
  // file is an error at start, not a crash mid-run: INVALID_ARGUMENT naming
  // the file when its size is not a whole number of tokens, when it holds
  // fewer than `min_tokens`, or when an id is >= `vocab_size` (the first
  // such id and its position). NOT_FOUND when it cannot be opened.
  static absl::StatusOr<TokenFile> Open(const std::string& path, int bytes_per_token,
                                        int64_t vocab_size, int64_t min_tokens);

  int64_t size() const { return tokens_; }  // tokens
  // Token `i` (0 <= i < size()).
  int64_t at(int64_t i) const;
  // Copies tokens [begin, begin + count) into `out` as int64.
  void Copy(int64_t begin, int64_t count, int64_t* out) const;
  const std::string& path() const { return file_.path(); }

 private:
  TokenFile(MappedFile file, int bytes_per_token, int64_t tokens)
      : file_(std::move(file)), bytes_per_token_(bytes_per_token), tokens_(tokens) {}
  MappedFile file_;
  int bytes_per_token_;
  int64_t tokens_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_TOKEN_FILE_H_
