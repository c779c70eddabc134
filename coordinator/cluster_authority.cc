#include "coordinator/cluster_authority.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/logging.h"

namespace geotrain {
namespace {

constexpr uint64_t kMaxPemFileBytes = 1 << 20;

bool IsIpAddress(const std::string& name) {
  unsigned char buffer[16];
  return inet_pton(AF_INET, name.c_str(), buffer) == 1 ||
         inet_pton(AF_INET6, name.c_str(), buffer) == 1;
}

// Reads `path`, or returns "" when it does not exist.
absl::StatusOr<std::string> ReadIfPresent(const std::string& path) {
  if (!std::filesystem::exists(path)) return std::string();
  return ReadFileBounded(path, kMaxPemFileBytes);
}

absl::StatusOr<CertifiedKey> LoadOrCreateCa(const std::string& dir) {
  const std::string cert_path = dir + "/ca.crt", key_path = dir + "/ca.key";
  absl::StatusOr<std::string> cert = ReadIfPresent(cert_path);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadIfPresent(key_path);
  if (!key.ok()) return key.status();
  if (!cert->empty() || !key->empty()) {
    if (absl::Status match = CheckKeyMatches(*cert, *key); !match.ok()) {
      return absl::DataLossError(
          absl::StrCat(cert_path, " and ", key_path, " do not form a CA: ", match.message()));
    }
    return CertifiedKey{*std::move(cert), *std::move(key)};
  }
  absl::StatusOr<CertifiedKey> ca =
      CreateCertificateAuthority("geotrain cluster CA", absl::Hours(24 * 3650));
  if (!ca.ok()) return ca.status();
  if (absl::Status written = WriteFileAtomically(key_path, ca->private_key_pem, 0600);
      !written.ok()) {
    return written;
  }
  if (absl::Status written = WriteFileAtomically(cert_path, ca->certificate_pem);
      !written.ok()) {
    return written;
  }
  GT_LOG(Info) << "created the cluster CA in " << dir;
  return ca;
}

// The stored certificate for `identity` when it is still valid for a day
// and issued by `ca`; otherwise a new one, stored.
absl::StatusOr<CertifiedKey> LoadOrIssue(const std::string& dir, const std::string& stem,
                                         const CertifiedKey& ca, const IssueOptions& options) {
  const std::string cert_path = absl::StrCat(dir, "/", stem, ".crt");
  const std::string key_path = absl::StrCat(dir, "/", stem, ".key");
  absl::StatusOr<std::string> cert = ReadIfPresent(cert_path);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadIfPresent(key_path);
  if (!key.ok()) return key.status();
  if (!cert->empty() && CheckKeyMatches(*cert, *key).ok() &&
      VerifyIssuedBy(*cert, ca.certificate_pem).ok()) {
    absl::StatusOr<absl::Time> expiry = CertificateNotAfter(*cert);
    if (expiry.ok() && *expiry - absl::Now() > absl::Hours(24)) {
      return CertifiedKey{*std::move(cert), *std::move(key)};
    }
  }
  absl::StatusOr<CertifiedKey> issued = IssueCertifiedKey(ca, options);
  if (!issued.ok()) return issued.status();
  if (absl::Status written = WriteFileAtomically(key_path, issued->private_key_pem, 0600);
      !written.ok()) {
    return written;
  }
  if (absl::Status written = WriteFileAtomically(cert_path, issued->certificate_pem);
      !written.ok()) {
    return written;
  }
  GT_LOG(Info) << "issued " << cert_path << " for '" << options.common_name << "'";
  return issued;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ClusterAuthority>> ClusterAuthority::Open(
    const ClusterAuthorityOptions& options) {
  std::error_code error;
  std::filesystem::create_directories(options.dir, error);
  if (error) return absl::UnavailableError(absl::StrCat(options.dir, ": ", error.message()));
  std::filesystem::permissions(options.dir, std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace, error);
  auto authority = std::unique_ptr<ClusterAuthority>(new ClusterAuthority());
  authority->options_ = options;
  absl::StatusOr<CertifiedKey> ca = LoadOrCreateCa(options.dir);
  if (!ca.ok()) return ca.status();
  authority->cluster_ca_ = *ca;

  const int given = !options.serving_certificate_path.empty() + !options.serving_key_path.empty() +
                    !options.serving_ca_path.empty();
  if (given != 0 && given != 3) {
    return absl::InvalidArgumentError("--tls_cert, --tls_key and --tls_ca go together");
  }
  TransportSecurity& server = authority->server_security_;
  server.insecure = false;
  server.trusted_ca_pem = ca->certificate_pem;
  std::string serving_ca_pem;
  if (given == 3) {
    for (auto [path, out] : {std::pair{options.serving_certificate_path, &server.certificate_pem},
                             {options.serving_key_path, &server.private_key_pem},
                             {options.serving_ca_path, &serving_ca_pem}}) {
      absl::StatusOr<std::string> text = ReadFileBounded(path, kMaxPemFileBytes);
      if (!text.ok()) return text.status();
      *out = *std::move(text);
    }
    if (absl::Status match = CheckKeyMatches(server.certificate_pem, server.private_key_pem);
        !match.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tls_key: ", match.message()));
    }
    if (absl::Status issued = VerifyIssuedBy(server.certificate_pem, serving_ca_pem);
        !issued.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tls_cert: ", issued.message(),
                                                     " (the CA of --tls_ca)"));
    }
  } else {
    IssueOptions serving;
    serving.common_name = kCoordinatorServerName;
    serving.dns_names = {kCoordinatorServerName, "localhost"};
    serving.ip_addresses = {"127.0.0.1", "::1"};
    for (const std::string& name : options.extra_names) {
      (IsIpAddress(name) ? serving.ip_addresses : serving.dns_names).push_back(name);
    }
    serving.validity = absl::Hours(24 * 365);
    absl::StatusOr<CertifiedKey> issued = LoadOrIssue(options.dir, "coordinator", *ca, serving);
    if (!issued.ok()) return issued.status();
    server.certificate_pem = issued->certificate_pem;
    server.private_key_pem = issued->private_key_pem;
    serving_ca_pem = ca->certificate_pem;
  }
  // The chain ends with the CA: a joiner pins it by fingerprint.
  server.certificate_pem += serving_ca_pem;
  absl::StatusOr<std::string> fingerprint = CertificateFingerprint(serving_ca_pem);
  if (!fingerprint.ok()) return fingerprint.status();
  authority->serving_ca_fingerprint_ = *fingerprint;

  IssueOptions admin;
  admin.common_name = kAdminIdentity;
  admin.server = false;
  admin.validity = absl::Hours(24 * 365);
  absl::StatusOr<CertifiedKey> admin_key = LoadOrIssue(options.dir, "admin", *ca, admin);
  if (!admin_key.ok()) return admin_key.status();
  TransportSecurity admin_security;
  admin_security.insecure = false;
  admin_security.certificate_pem = admin_key->certificate_pem;
  admin_security.private_key_pem = admin_key->private_key_pem;
  admin_security.trusted_ca_pem = serving_ca_pem;
  authority->admin_credential_path_ = options.dir + "/admin.credential";
  if (absl::Status written = WriteFileAtomically(
          authority->admin_credential_path_,
          FormatCredentialFile("geotrain admin credential: keep it secret "
                               "(geotrain-ctl --admin_credential=FILE)",
                               admin_security),
          0600);
      !written.ok()) {
    return written;
  }
  return authority;
}

absl::StatusOr<std::string> ClusterAuthority::IssueWorkerCertificate(
    const std::string& csr_pem, const std::string& worker_id) const {
  IssueOptions options;
  options.common_name = worker_id;
  options.dns_names = {worker_id};
  options.validity = options_.worker_certificate_validity;
  return IssueCertificateForCsr(csr_pem, cluster_ca_, options);
}

}  // namespace geotrain
