// The few X.509 operations a small cluster CA needs, on PEM strings, with
// OpenSSL: P-256 keys, a self-signed CA, CSRs, certificates issued for an
// identity the issuer chooses (never the one a CSR asks for), fingerprints,
// and the chain a TLS server presents (for pinning a CA by fingerprint, as
// `kubeadm join --discovery-token-ca-cert-hash` does). Torch-free and
// thread-safe (no shared state).
#ifndef GEOTRAIN_COMMON_X509_H_
#define GEOTRAIN_COMMON_X509_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace geotrain {

struct CertifiedKey {
  std::string certificate_pem;
  std::string private_key_pem;
};

// A new ECDSA P-256 private key, PEM (PKCS#8).
absl::StatusOr<std::string> GeneratePrivateKeyPem();

// A self-signed CA certificate (basicConstraints CA:TRUE, keyCertSign) and
// its key.
absl::StatusOr<CertifiedKey> CreateCertificateAuthority(const std::string& common_name,
                                                        absl::Duration validity);

// A certificate signing request for `private_key_pem`. Only its public key
// matters to the issuer; the subject is informative.
absl::StatusOr<std::string> CreateCsrPem(const std::string& private_key_pem,
                                         const std::string& common_name);

struct IssueOptions {
  std::string common_name;              // the identity: a worker id, "admin", ...
  std::vector<std::string> dns_names;   // subjectAltName DNS entries
  std::vector<std::string> ip_addresses;  // subjectAltName IP entries (v4 or v6)
  absl::Duration validity = absl::Hours(24 * 365);
  bool server = true;  // extendedKeyUsage serverAuth (clientAuth always)
};

// OK when `csr_pem` is a PEM CSR (at most 16 KiB) whose signature verifies
// with its own key; INVALID_ARGUMENT otherwise.
absl::Status CheckCsr(const std::string& csr_pem);

// Signs the public key of `csr_pem` (whose own signature must verify) with
// the CA. INVALID_ARGUMENT for a malformed or unsigned CSR.
absl::StatusOr<std::string> IssueCertificateForCsr(const std::string& csr_pem,
                                                   const CertifiedKey& ca,
                                                   const IssueOptions& options);
// A new key and a certificate for it, signed by the CA.
absl::StatusOr<CertifiedKey> IssueCertifiedKey(const CertifiedKey& ca,
                                               const IssueOptions& options);

// "sha256:<64 hex>" of the certificate's DER encoding.
absl::StatusOr<std::string> CertificateFingerprint(const std::string& certificate_pem);
absl::StatusOr<std::string> CertificateCommonName(const std::string& certificate_pem);
absl::StatusOr<absl::Time> CertificateNotAfter(const std::string& certificate_pem);
// OK when `certificate_pem` is signed by `ca_pem`'s key and is valid now.
absl::Status VerifyIssuedBy(const std::string& certificate_pem, const std::string& ca_pem);
// OK when the key belongs to the certificate.
absl::Status CheckKeyMatches(const std::string& certificate_pem,
                             const std::string& private_key_pem);

// The PEM blocks of `bundle`, in order (certificates and keys alike).
std::vector<std::string> SplitPemBlocks(const std::string& bundle);

// Opens a TLS connection to HOST:PORT (ALPN h2, as gRPC expects), takes the
// certificate chain the server presents without verifying it, and closes.
// The caller decides what to trust (see PinCertificateAuthority).
absl::StatusOr<std::vector<std::string>> FetchServerCertificateChain(const std::string& address,
                                                                     absl::Duration timeout);

// Finds in the chain served at `address` the CA whose fingerprint is
// `fingerprint` and that issued the server's certificate; returns its PEM.
// UNAUTHENTICATED (naming both fingerprints) when there is none: the server
// is not the coordinator the token was made for.
absl::StatusOr<std::string> PinCertificateAuthority(const std::string& address,
                                                    const std::string& fingerprint,
                                                    absl::Duration timeout);

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_X509_H_
