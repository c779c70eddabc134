#include "coordinator/access_store.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/join_token.h"

namespace geotrain {
namespace {

const std::string kCa = "sha256:" + std::string(64, 'c');

class AccessStoreTest : public testing::Test {
 protected:
  void SetUp() override {
    path_ = testing::TempDir() + "/access_" +
            testing::UnitTest::GetInstance()->current_test_info()->name() + ".textproto";
    std::filesystem::remove(path_);
    Reopen();
  }
  void Reopen() {
    auto store = AccessStore::Open(path_, kCa, [this] { return now_; });
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  std::string Create(int uses = 0, v1::TokenRole role = v1::TOKEN_ROLE_WORKER,
                     int64_t ttl_s = 3600) {
    v1::CreateTokenRequest request;
    request.set_uses(uses);
    request.set_role(role);
    request.set_ttl_s(ttl_s);
    request.set_label("test");
    auto created = store_->CreateToken(request);
    EXPECT_TRUE(created.ok()) << created.status();
    return created->token();
  }
  absl::StatusCode Redeem(const std::string& token, std::string* id = nullptr) {
    std::string token_id;
    auto redeemed = store_->RedeemForWorker(
        token, [this](const std::string& w) { return taken_.count(w) > 0; }, &token_id);
    if (redeemed.ok() && id != nullptr) *id = *redeemed;
    return redeemed.status().code();
  }

  std::string path_;
  absl::Time now_ = absl::FromUnixSeconds(1'800'000'000);
  std::set<std::string> taken_;
  std::unique_ptr<AccessStore> store_;
};

TEST_F(AccessStoreTest, TokensAreUsedUpExpireAndAreRevoked) {
  const std::string twice = Create(2);
  std::string first, second;
  EXPECT_EQ(Redeem(twice, &first), absl::StatusCode::kOk);
  EXPECT_EQ(Redeem(twice, &second), absl::StatusCode::kOk);
  EXPECT_NE(first, second);
  EXPECT_EQ(Redeem(twice), absl::StatusCode::kPermissionDenied);  // used up

  const std::string expiring = Create(0, v1::TOKEN_ROLE_WORKER, 60);
  EXPECT_TRUE(store_->CheckToken(expiring, v1::TOKEN_ROLE_WORKER).ok());
  now_ += absl::Seconds(61);
  EXPECT_EQ(Redeem(expiring), absl::StatusCode::kPermissionDenied);

  const std::string revoked = Create();
  ASSERT_TRUE(store_->RevokeToken(revoked).ok());  // by the whole token
  EXPECT_EQ(Redeem(revoked), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(store_->RevokeToken("nosuch").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(AccessStoreTest, WrongSecretsUnknownIdsAndOtherCasAreUnauthenticated) {
  const std::string token = Create();
  JoinToken parsed = *ParseJoinToken(token);
  JoinToken wrong = parsed;
  wrong.secret[0] = wrong.secret[0] == 'a' ? 'b' : 'a';
  EXPECT_EQ(Redeem(FormatJoinToken(wrong)), absl::StatusCode::kUnauthenticated);
  JoinToken unknown = parsed;
  unknown.id = "zzzzzz";
  EXPECT_EQ(Redeem(FormatJoinToken(unknown)), absl::StatusCode::kUnauthenticated);
  JoinToken other_ca = parsed;
  other_ca.ca_fingerprint = "sha256:" + std::string(64, 'd');
  EXPECT_EQ(Redeem(FormatJoinToken(other_ca)), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Redeem("garbage"), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Redeem(token), absl::StatusCode::kOk);
}

TEST_F(AccessStoreTest, RolesAreKeptApart) {
  const std::string viewer = Create(0, v1::TOKEN_ROLE_VIEWER);
  EXPECT_TRUE(store_->CheckToken(viewer, v1::TOKEN_ROLE_VIEWER).ok());
  EXPECT_EQ(Redeem(viewer), absl::StatusCode::kPermissionDenied);
  const std::string worker = Create();
  EXPECT_EQ(store_->CheckToken(worker, v1::TOKEN_ROLE_VIEWER).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(AccessStoreTest, StateSurvivesAReopenAndIdsAreNeverReused) {
  const std::string token = Create(3);
  taken_ = {"w0", "w1"};  // joined insecure before, say
  std::string id;
  ASSERT_EQ(Redeem(token, &id), absl::StatusCode::kOk);
  EXPECT_EQ(id, "w2");
  ASSERT_TRUE(store_->RevokeWorker("w2").ok());
  Reopen();
  EXPECT_TRUE(store_->IsWorkerRevoked("w2"));
  EXPECT_FALSE(store_->IsWorkerRevoked("w3"));
  EXPECT_EQ(store_->TokenOfWorker("w2"), ParseJoinToken(token)->id);
  std::string next;
  ASSERT_EQ(Redeem(token, &next), absl::StatusCode::kOk);
  EXPECT_EQ(next, "w3");
  const v1::ListTokensResponse list = store_->ListTokens();
  ASSERT_EQ(list.tokens_size(), 1);
  EXPECT_EQ(list.tokens(0).uses_left(), 1);
  EXPECT_EQ(list.tokens(0).workers_size(), 2);
  // Only the secret's hash is on disk.
  std::ifstream in(path_);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str().find(ParseJoinToken(token)->secret), std::string::npos);
  EXPECT_EQ(std::filesystem::status(path_).permissions() & std::filesystem::perms::others_read,
            std::filesystem::perms::none);
}

TEST_F(AccessStoreTest, AbsurdRequestsAreRefused) {
  v1::CreateTokenRequest request;
  request.set_ttl_s(-1);
  EXPECT_FALSE(store_->CreateToken(request).ok());
  request.set_ttl_s(100LL * 365 * 24 * 3600);
  EXPECT_FALSE(store_->CreateToken(request).ok());
  request.set_ttl_s(60);
  request.set_label(std::string(1000, 'x'));
  EXPECT_FALSE(store_->CreateToken(request).ok());
}

TEST(AccessStoreOpenTest, ACorruptFileIsDataLoss) {
  const std::string path = testing::TempDir() + "/access_corrupt.textproto";
  std::ofstream(path) << "tokens { not valid";
  EXPECT_EQ(AccessStore::Open(path, kCa).status().code(), absl::StatusCode::kDataLoss);
}

// Issue 32: `worker revoke` failed for an identity that enrolled but never
// joined; relays need a relay token, whose identities are relays only.
TEST_F(AccessStoreTest, IssuedIdentitiesRelayRolesAndTheRevokedList) {
  std::string enrolled, relay;
  ASSERT_EQ(Redeem(Create(), &enrolled), absl::StatusCode::kOk);
  EXPECT_TRUE(store_->IssuedWorker(enrolled));
  EXPECT_FALSE(store_->IssuedWorker("w999"));
  EXPECT_FALSE(store_->IssuedWorker("w01")) << "only the exact spelling";
  EXPECT_FALSE(store_->IssuedWorker("admin"));
  EXPECT_EQ(store_->RoleOfWorker(enrolled), v1::TOKEN_ROLE_WORKER);
  const std::string relay_token = Create(1, v1::TOKEN_ROLE_RELAY);
  EXPECT_TRUE(store_->CheckToken(relay_token, v1::TOKEN_ROLE_WORKER).ok())
      << "a relay enrolls as any identity does";
  EXPECT_EQ(store_->CheckToken(relay_token, v1::TOKEN_ROLE_VIEWER).status().code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_EQ(Redeem(relay_token, &relay), absl::StatusCode::kOk);
  EXPECT_EQ(store_->RoleOfWorker(relay), v1::TOKEN_ROLE_RELAY);
  EXPECT_EQ(store_->RoleOfWorker("w999"), v1::TOKEN_ROLE_UNSPECIFIED);
  ASSERT_TRUE(store_->RevokeWorker(enrolled).ok());
  ASSERT_TRUE(store_->RevokeWorker(relay).ok());
  EXPECT_EQ(store_->RevokedWorkers(1), std::vector<std::string>{relay});
  EXPECT_EQ(store_->RevokedWorkers(10), (std::vector<std::string>{enrolled, relay}));
}

}  // namespace
}  // namespace geotrain
