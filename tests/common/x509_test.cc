#include "common/x509.h"

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include "common/transport_security.h"
#include "geotrain/v1/status.grpc.pb.h"

namespace geotrain {
namespace {

CertifiedKey Ca() {
  absl::StatusOr<CertifiedKey> ca = CreateCertificateAuthority("test CA", absl::Hours(1));
  EXPECT_TRUE(ca.ok()) << ca.status();
  return *ca;
}

TEST(X509Test, IssuesForTheIdentityTheIssuerChooses) {
  const CertifiedKey ca = Ca();
  const std::string key = *GeneratePrivateKeyPem();
  const std::string csr = *CreateCsrPem(key, "admin");  // what the CSR asks is ignored
  IssueOptions options;
  options.common_name = "w7";
  options.dns_names = {"w7"};
  absl::StatusOr<std::string> cert = IssueCertificateForCsr(csr, ca, options);
  ASSERT_TRUE(cert.ok()) << cert.status();
  EXPECT_EQ(*CertificateCommonName(*cert), "w7");
  EXPECT_TRUE(VerifyIssuedBy(*cert, ca.certificate_pem).ok());
  EXPECT_TRUE(CheckKeyMatches(*cert, key).ok());
  EXPECT_FALSE(CheckKeyMatches(*cert, *GeneratePrivateKeyPem()).ok());
  EXPECT_FALSE(VerifyIssuedBy(*cert, Ca().certificate_pem).ok()) << "another CA";
  EXPECT_GT(*CertificateNotAfter(*cert), absl::Now());
  const std::string print = *CertificateFingerprint(ca.certificate_pem);
  EXPECT_EQ(print.rfind("sha256:", 0), 0u);
  EXPECT_EQ(print.size(), 7u + 64u);
}

TEST(X509Test, RefusesMalformedOrForgedCsrs) {
  const CertifiedKey ca = Ca();
  IssueOptions options;
  options.common_name = "w1";
  EXPECT_EQ(IssueCertificateForCsr("not a csr", ca, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(IssueCertificateForCsr(std::string(20000, 'x'), ca, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A CSR whose signature does not match its key.
  std::string csr = *CreateCsrPem(*GeneratePrivateKeyPem(), "x");
  const size_t body = csr.find('\n') + 40;
  csr[body] = csr[body] == 'A' ? 'B' : 'A';
  EXPECT_FALSE(IssueCertificateForCsr(csr, ca, options).ok());
  EXPECT_EQ(CheckCsr(csr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCsr("not a csr").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckCsr(*CreateCsrPem(*GeneratePrivateKeyPem(), "x")).ok());
}

TEST(X509Test, SplitsPemBundles) {
  const CertifiedKey ca = Ca();
  const std::vector<std::string> blocks =
      SplitPemBlocks("# comment\n" + ca.certificate_pem + "junk\n" + ca.private_key_pem);
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_NE(blocks[0].find("BEGIN CERTIFICATE"), std::string::npos);
  EXPECT_NE(blocks[1].find("PRIVATE KEY"), std::string::npos);
  EXPECT_TRUE(SplitPemBlocks("-----BEGIN X-----\nno end").empty());
}

// A real gRPC TLS server: the CA is pinned from its chain by fingerprint,
// and a client certificate's common name is what the server sees.
class EchoStatus final : public v1::Status::Service {
 public:
  grpc::Status GetClusterStatus(grpc::ServerContext* context, const v1::ClusterStatusRequest*,
                                v1::ClusterStatus* response) override {
    response->set_job(PeerIdentity(*context));
    return grpc::Status::OK;
  }
};

TEST(X509Test, PinsTheServedCaAndCarriesClientIdentities) {
  const CertifiedKey ca = Ca();
  IssueOptions serving;
  serving.common_name = kCoordinatorServerName;
  serving.dns_names = {kCoordinatorServerName};
  const CertifiedKey server_key = *IssueCertifiedKey(ca, serving);
  TransportSecurity server;
  server.insecure = false;
  server.certificate_pem = server_key.certificate_pem + ca.certificate_pem;
  server.private_key_pem = server_key.private_key_pem;
  server.trusted_ca_pem = ca.certificate_pem;
  EchoStatus service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0",
                           MakeServerCredentials(server, ClientCertificates::kOptional), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> running = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);

  absl::StatusOr<std::string> pinned =
      PinCertificateAuthority(address, *CertificateFingerprint(ca.certificate_pem),
                              absl::Seconds(5));
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(*CertificateFingerprint(*pinned), *CertificateFingerprint(ca.certificate_pem));
  absl::StatusOr<std::string> wrong =
      PinCertificateAuthority(address, "sha256:" + std::string(64, '0'), absl::Seconds(5));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(wrong.status().message().find("not the coordinator"), std::string::npos);

  auto call = [&](const TransportSecurity& client, const std::string& name) {
    auto stub = v1::Status::NewStub(MakeSecureChannel(address, client, name));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ClusterStatus status;
    grpc::Status rpc = stub->GetClusterStatus(&context, v1::ClusterStatusRequest(), &status);
    return std::make_pair(rpc, status.job());
  };
  TransportSecurity anonymous;
  anonymous.insecure = false;
  anonymous.trusted_ca_pem = *pinned;
  auto [ok, nobody] = call(anonymous, kCoordinatorServerName);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(nobody, "");
  IssueOptions worker;
  worker.common_name = "w3";
  worker.dns_names = {"w3"};
  const CertifiedKey worker_key = *IssueCertifiedKey(ca, worker);
  TransportSecurity as_worker = anonymous;
  as_worker.certificate_pem = worker_key.certificate_pem;
  as_worker.private_key_pem = worker_key.private_key_pem;
  auto [ok2, identity] = call(as_worker, kCoordinatorServerName);
  ASSERT_TRUE(ok2.ok()) << ok2.error_message();
  EXPECT_EQ(identity, "w3");
  // The server's certificate does not name "w3": a client expecting w3 refuses it.
  EXPECT_FALSE(call(as_worker, "w3").first.ok());
  // A client certificate from another CA fails the handshake.
  const CertifiedKey other = *IssueCertifiedKey(Ca(), worker);
  TransportSecurity forged = anonymous;
  forged.certificate_pem = other.certificate_pem;
  forged.private_key_pem = other.private_key_pem;
  EXPECT_FALSE(call(forged, kCoordinatorServerName).first.ok());
  running->Shutdown();
}

}  // namespace
}  // namespace geotrain
