#include "common/token_file.h"

#include "absl/strings/str_cat.h"

namespace geotrain {

absl::StatusOr<TokenFile> TokenFile::Open(const std::string& path, int bytes_per_token,
                                          int64_t vocab_size, int64_t min_tokens) {
  if (bytes_per_token != 2 && bytes_per_token != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tokens must be 2 or 4 bytes, not ", bytes_per_token));
  }
  absl::StatusOr<MappedFile> file = MappedFile::Open(path);
  if (!file.ok()) return file.status();
  if (file->size() % bytes_per_token != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", file->size(),
                                                   " bytes is not a whole number of ",
                                                   bytes_per_token, "-byte tokens"));
  }
  const int64_t tokens = static_cast<int64_t>(file->size() / bytes_per_token);
  if (tokens < min_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", tokens, " tokens, fewer than the ",
                                                   min_tokens, " one sample needs"));
  }
  TokenFile out(*std::move(file), bytes_per_token, tokens);
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t id = out.at(i);
    if (id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": token id ", id, " at position ", i,
                                                     " is out of range for a vocabulary of ",
                                                     vocab_size));
    }
  }
  return out;
}

int64_t TokenFile::at(int64_t i) const {
  const uint8_t* p = file_.data() + static_cast<uint64_t>(i) * bytes_per_token_;
  uint64_t v = 0;
  for (int b = bytes_per_token_ - 1; b >= 0; --b) v = (v << 8) | p[b];
  return static_cast<int64_t>(v);
}

void TokenFile::Copy(int64_t begin, int64_t count, int64_t* out) const {
  for (int64_t i = 0; i < count; ++i) out[i] = at(begin + i);
}

}  // namespace geotrain
