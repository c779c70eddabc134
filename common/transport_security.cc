#include "common/transport_security.h"

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/rpc_options.h"
#include "common/x509.h"

namespace geotrain {

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(
    const TransportSecurity& security) {
  if (security.insecure) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = security.trusted_ca_pem;
  options.pem_private_key = security.private_key_pem;
  options.pem_cert_chain = security.certificate_pem;
  return grpc::SslCredentials(options);
}

std::shared_ptr<grpc::Channel> MakeSecureChannel(const std::string& address,
                                                 const TransportSecurity& security,
                                                 const std::string& server_name,
                                                 Connection connection) {
  grpc::ChannelArguments args = DefaultChannelArguments(connection);
  if (!security.insecure) args.SetSslTargetNameOverride(server_name);
  return grpc::CreateCustomChannel(address, MakeChannelCredentials(security), args);
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const TransportSecurity& security, ClientCertificates client_certificates) {
  if (security.insecure) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      client_certificates == ClientCertificates::kRequire
          ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
          : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = security.trusted_ca_pem;
  options.pem_key_cert_pairs.push_back({security.private_key_pem, security.certificate_pem});
  return grpc::SslServerCredentials(options);
}

std::string FormatCredentialFile(const std::string& comment, const TransportSecurity& security) {
  return absl::StrCat("# ", comment, "\n", security.certificate_pem, security.private_key_pem,
                      security.trusted_ca_pem);
}

absl::StatusOr<TransportSecurity> LoadCredentialFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileBounded(path, 1 << 20);
  if (!text.ok()) return text.status();
  TransportSecurity security;
  security.insecure = false;
  for (const std::string& block : SplitPemBlocks(*text)) {
    if (block.find("PRIVATE KEY-----") != std::string::npos) {
      security.private_key_pem = block;
    } else if (block.find("BEGIN CERTIFICATE") != std::string::npos) {
      (security.certificate_pem.empty() ? security.certificate_pem : security.trusted_ca_pem) +=
          block;
    }
  }
  if (security.certificate_pem.empty() || security.private_key_pem.empty() ||
      security.trusted_ca_pem.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " is not a geotrain credential (a certificate, its key and the CA, PEM)"));
  }
  if (absl::Status match = CheckKeyMatches(security.certificate_pem, security.private_key_pem);
      !match.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", match.message()));
  }
  return security;
}

std::string PeerIdentity(const grpc::ServerContextBase& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  std::vector<grpc::string_ref> names = auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME);
  if (names.size() != 1) return "";
  return std::string(names[0].data(), names[0].size());
}

}  // namespace geotrain
