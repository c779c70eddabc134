#include "common/join_token.h"

#include <gtest/gtest.h>

#include <string>

namespace geotrain {
namespace {

const std::string kFingerprint =
    "sha256:54884f13024d8f3a291b2990a8923d52b6e69b7522001690aa853cc2d55bffb2";

TEST(JoinTokenTest, NewTokensRoundTrip) {
  absl::StatusOr<JoinToken> token = NewJoinToken(kFingerprint);
  ASSERT_TRUE(token.ok());
  EXPECT_EQ(token->id.size(), kTokenIdLength);
  EXPECT_EQ(token->secret.size(), kTokenSecretLength);
  const std::string text = FormatJoinToken(*token);
  absl::StatusOr<JoinToken> parsed = ParseJoinToken("  " + text + "\n");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->id, token->id);
  EXPECT_EQ(parsed->secret, token->secret);
  EXPECT_EQ(parsed->ca_fingerprint, kFingerprint);
  EXPECT_NE(FormatJoinToken(*NewJoinToken(kFingerprint)), text) << "tokens are random";
}

TEST(JoinTokenTest, MalformedTokensSayWhichPartIsWrong) {
  const std::string hex(64, 'a');
  const std::string secret(32, 'b');
  struct Case {
    std::string text;
    std::string fragment;
  };
  const Case cases[] = {
      {"", "not a geotrain join token"},
      {"gt2.abcdef." + secret + "." + hex, "not a geotrain join token"},
      {"gt1.abcdef." + secret, "not a geotrain join token"},
      {"gt1.abcdef." + secret + "." + hex + ".x", "not a geotrain join token"},
      {"gt1.ABCDEF." + secret + "." + hex, "id"},
      {"gt1.abcde." + secret + "." + hex, "id"},
      {"gt1.abcdef." + secret.substr(1) + "." + hex, "secret"},
      {"gt1.abcdef." + secret + "!." + hex, "secret"},
      {"gt1.abcdef." + secret + "." + hex.substr(2), "fingerprint"},
      {"gt1.abcdef." + secret + "." + std::string(64, 'g'), "fingerprint"},
      {std::string(100000, 'x'), "longer than 256"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<JoinToken> parsed = ParseJoinToken(c.text);
    ASSERT_FALSE(parsed.ok()) << c.text;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(c.fragment), std::string::npos)
        << c.text.substr(0, 80) << ": " << parsed.status();
  }
}

TEST(JoinTokenTest, SecretsAreComparedByHash) {
  EXPECT_EQ(HashTokenSecret("abc").size(), 64u);
  EXPECT_EQ(HashTokenSecret("abc"), HashTokenSecret("abc"));
  EXPECT_NE(HashTokenSecret("abc"), HashTokenSecret("abd"));
  EXPECT_TRUE(ConstantTimeEquals("same", "same"));
  EXPECT_FALSE(ConstantTimeEquals("same", "sama"));
  EXPECT_FALSE(ConstantTimeEquals("same", "same!"));
}

}  // namespace
}  // namespace geotrain
