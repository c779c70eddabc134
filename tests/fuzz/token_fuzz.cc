// Join tokens and the PEM/credential handling a token holder's input
// reaches: a token that parses must format back to itself (modulo
// surrounding whitespace); PEM bundles are split without reading past
// their end; a CSR is parsed and its signature checked.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tests/fuzz/fuzz_input.h"

#include "absl/strings/ascii.h"
#include "common/join_token.h"
#include "common/x509.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (32 << 10)) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<geotrain::JoinToken> token = geotrain::ParseJoinToken(text);
  if (token.ok()) {
    const std::string formatted = geotrain::FormatJoinToken(*token);
    if (formatted != absl::StripAsciiWhitespace(text)) std::abort();
    absl::StatusOr<geotrain::JoinToken> again = geotrain::ParseJoinToken(formatted);
    if (!again.ok() || again->secret != token->secret) std::abort();
  }
  (void)geotrain::SplitPemBlocks(text);
  static const geotrain::CertifiedKey* ca = new geotrain::CertifiedKey(
      *geotrain::CreateCertificateAuthority("fuzz CA", absl::Hours(1)));
  geotrain::IssueOptions options;
  options.common_name = "w1";
  (void)geotrain::IssueCertificateForCsr(text, *ca, options);
  (void)geotrain::CertificateFingerprint(text);
  return 0;
}
