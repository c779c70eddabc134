// The coordinator's certificate authority, kept in <state_dir>/tls/:
//   ca.crt, ca.key             the cluster CA (created on first start)
//   coordinator.crt/.key       the serving certificate (kCoordinatorServerName
//                              plus the names given), reissued when it expires
//   admin.credential           the operator's credential (mode 0600)
// With the operator's own serving certificate (--tls_cert/--tls_key/--tls_ca)
// the coordinator serves that instead, and tokens carry the fingerprint of
// the operator's CA; worker certificates still come from the cluster CA.
// Immutable after Open(); thread-safe.
#ifndef GEOTRAIN_COORDINATOR_CLUSTER_AUTHORITY_H_
#define GEOTRAIN_COORDINATOR_CLUSTER_AUTHORITY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport_security.h"
#include "common/x509.h"

namespace geotrain {

struct ClusterAuthorityOptions {
  std::string dir;  // <state_dir>/tls
  // The operator's serving certificate, its key and its CA (all or none).
  std::string serving_certificate_path;
  std::string serving_key_path;
  std::string serving_ca_path;
  // Extra DNS names or IP addresses for the generated serving certificate.
  std::vector<std::string> extra_names;
  absl::Duration worker_certificate_validity = absl::Hours(24 * 90);
};

class ClusterAuthority {
 public:
  static absl::StatusOr<std::unique_ptr<ClusterAuthority>> Open(
      const ClusterAuthorityOptions& options);

  // What the coordinator's server presents (its chain ends with its CA, so
  // a joiner can pin that CA by fingerprint) and whose client certificates
  // it accepts (the cluster CA's).
  const TransportSecurity& server_security() const { return server_security_; }
  // The fingerprint tokens carry: of the CA that signed the serving certificate.
  const std::string& serving_ca_fingerprint() const { return serving_ca_fingerprint_; }
  // The CA that signs worker certificates (PEM).
  const std::string& cluster_ca_pem() const { return cluster_ca_.certificate_pem; }
  const std::string& admin_credential_path() const { return admin_credential_path_; }

  // A certificate for the key of `csr_pem` whose common name (and DNS name)
  // is `worker_id`.
  absl::StatusOr<std::string> IssueWorkerCertificate(const std::string& csr_pem,
                                                     const std::string& worker_id) const;

 private:
  ClusterAuthority() = default;

  ClusterAuthorityOptions options_;
  CertifiedKey cluster_ca_;
  TransportSecurity server_security_;
  std::string serving_ca_fingerprint_;
  std::string admin_credential_path_;
};

}  // namespace geotrain

#endif  // GEOTRAIN_COORDINATOR_CLUSTER_AUTHORITY_H_
