// TLS settings of one process and the gRPC credentials built from them.
//
// A geotrain cluster has one CA (the coordinator's, see coordinator/
// cluster_authority.h). Every worker holds a certificate whose common name
// is its worker id; the coordinator's serving certificate carries the name
// kCoordinatorServerName. A client checks the name it expects (the
// coordinator's, or the worker id the plan puts at the far end of a link),
// so a certificate of the same CA issued to someone else does not pass.
// `insecure` is plaintext with no identities (loopback demos and tests).
#ifndef GEOTRAIN_COMMON_TRANSPORT_SECURITY_H_
#define GEOTRAIN_COMMON_TRANSPORT_SECURITY_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/rpc_options.h"

namespace geotrain {

inline constexpr char kCoordinatorServerName[] = "geotrain-coordinator";
// The common name of the operator's admin credential.
inline constexpr char kAdminIdentity[] = "admin";
// Metadata key of a bearer token (viewer tokens for the status API).
inline constexpr char kTokenMetadataKey[] = "x-geotrain-token";

struct TransportSecurity {
  bool insecure = true;
  std::string trusted_ca_pem;   // CA that servers this process dials must chain to
  std::string certificate_pem;  // this process's own identity (client and server)
  std::string private_key_pem;  // empty with certificate_pem: no client certificate

  static TransportSecurity Insecure() { return TransportSecurity(); }
};

// Channel credentials that verify the server against `trusted_ca_pem` and
// present this process's certificate when it has one.
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(
    const TransportSecurity& security);

// A channel (DefaultChannelArguments) to `address` whose server must
// present a certificate for `server_name` (ignored when insecure).
std::shared_ptr<grpc::Channel> MakeSecureChannel(const std::string& address,
                                                 const TransportSecurity& security,
                                                 const std::string& server_name,
                                                 Connection connection = Connection::kShared);

enum class ClientCertificates {
  kRequire,  // worker Stage services: only cluster members connect
  kOptional  // the coordinator: joiners without a certificate yet, viewers
};
// Server credentials presenting this process's certificate; client
// certificates, when presented, must chain to `trusted_ca_pem`.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(
    const TransportSecurity& security, ClientCertificates client_certificates);

// A credential file: a comment line, then the identity's certificate, its
// private key, and the CA(s) it trusts, all PEM. The coordinator writes the
// admin's as <state_dir>/tls/admin.credential; a worker keeps its own in
// its --state_dir.
std::string FormatCredentialFile(const std::string& comment, const TransportSecurity& security);
// INVALID_ARGUMENT (naming the file) unless it holds a certificate, the key
// that belongs to it, and at least one more certificate (the CA).
absl::StatusOr<TransportSecurity> LoadCredentialFile(const std::string& path);

// The common name of the verified client certificate of the call, or ""
// when the caller presented none (or the server is insecure).
std::string PeerIdentity(const grpc::ServerContextBase& context);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_TRANSPORT_SECURITY_H_
