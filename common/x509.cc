#include "common/x509.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/escaping.h"

namespace geotrain {
namespace {

template <typename T, void (*Free)(T*)>
struct Deleter {
  void operator()(T* p) const { Free(p); }
};
using Bio = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;
using Key = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using Cert = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using Req = std::unique_ptr<X509_REQ, Deleter<X509_REQ, X509_REQ_free>>;
using SslCtx = std::unique_ptr<SSL_CTX, Deleter<SSL_CTX, SSL_CTX_free>>;
using Ssl = std::unique_ptr<SSL, Deleter<SSL, SSL_free>>;

// The OpenSSL error queue as text (and emptied).
std::string OpenSslErrors() {
  std::string text;
  while (unsigned long code = ERR_get_error()) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    absl::StrAppend(&text, text.empty() ? "" : "; ", buffer);
  }
  return text.empty() ? "no detail" : text;
}

absl::Status Failure(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", OpenSslErrors()));
}

Bio MemoryBio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

std::string BioText(BIO* bio) {
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio, &data);
  return std::string(data, size > 0 ? size : 0);
}

absl::StatusOr<Key> ReadKey(const std::string& pem) {
  Bio bio = MemoryBio(pem);
  Key key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError("not a PEM private key");
  }
  return key;
}

absl::StatusOr<Cert> ReadCert(const std::string& pem) {
  Bio bio = MemoryBio(pem);
  Cert cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError("not a PEM certificate");
  }
  return cert;
}

std::string CertPem(X509* cert) {
  Bio bio(BIO_new(BIO_s_mem()));
  PEM_write_bio_X509(bio.get(), cert);
  return BioText(bio.get());
}

absl::StatusOr<Key> NewKey() {
  Key key(EVP_EC_gen("P-256"));
  if (key == nullptr) return Failure("generating a P-256 key");
  return key;
}

std::string KeyPem(EVP_PKEY* key) {
  Bio bio(BIO_new(BIO_s_mem()));
  PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr);
  return BioText(bio.get());
}

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return Failure(absl::StrCat("extension ", OBJ_nid2sn(nid), "=", value));
  const int added = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  if (added != 1) return Failure("adding an extension");
  return absl::OkStatus();
}

// A certificate for `subject_key`, with a random 128-bit serial, valid from
// an hour ago (clock skew) for `validity`, signed by `issuer_key` (itself
// when `issuer` is null).
absl::StatusOr<Cert> NewCertificate(EVP_PKEY* subject_key, const std::string& common_name,
                                    X509* issuer, EVP_PKEY* issuer_key,
                                    absl::Duration validity) {
  Cert cert(X509_new());
  X509_set_version(cert.get(), 2);
  unsigned char serial[16];
  RAND_bytes(serial, sizeof(serial));
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof(serial), nullptr);
  BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get()));
  BN_free(bn);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), absl::ToInt64Seconds(validity));
  X509_set_pubkey(cert.get(), subject_key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8,
                             reinterpret_cast<const unsigned char*>("geotrain"), -1, -1, 0);
  if (X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8,
                                 reinterpret_cast<const unsigned char*>(common_name.c_str()),
                                 -1, -1, 0) != 1) {
    return Failure(absl::StrCat("common name '", common_name, "'"));
  }
  X509_set_issuer_name(cert.get(), issuer != nullptr ? X509_get_subject_name(issuer) : name);
  return cert;
}

absl::Status Sign(X509* cert, EVP_PKEY* key) {
  if (X509_sign(cert, key, EVP_sha256()) <= 0) return Failure("signing a certificate");
  return absl::OkStatus();
}

absl::StatusOr<std::string> IssueForKey(EVP_PKEY* subject_key, const CertifiedKey& ca,
                                        const IssueOptions& options) {
  absl::StatusOr<Cert> ca_cert = ReadCert(ca.certificate_pem);
  if (!ca_cert.ok()) return ca_cert.status();
  absl::StatusOr<Key> ca_key = ReadKey(ca.private_key_pem);
  if (!ca_key.ok()) return ca_key.status();
  absl::StatusOr<Cert> cert = NewCertificate(subject_key, options.common_name, ca_cert->get(),
                                             ca_key->get(), options.validity);
  if (!cert.ok()) return cert.status();
  std::vector<std::string> names;
  for (const std::string& dns : options.dns_names) names.push_back("DNS:" + dns);
  for (const std::string& ip : options.ip_addresses) names.push_back("IP:" + ip);
  for (auto [nid, value] : {std::pair<int, std::string>{NID_basic_constraints, "critical,CA:FALSE"},
                            {NID_key_usage, "critical,digitalSignature,keyEncipherment"},
                            {NID_ext_key_usage, options.server ? "serverAuth,clientAuth"
                                                               : "clientAuth"},
                            {NID_subject_key_identifier, "hash"},
                            {NID_authority_key_identifier, "keyid:always"}}) {
    if (absl::Status added = AddExtension(cert->get(), ca_cert->get(), nid, value); !added.ok()) {
      return added;
    }
  }
  if (!names.empty()) {
    absl::Status added =
        AddExtension(cert->get(), ca_cert->get(), NID_subject_alt_name, absl::StrJoin(names, ","));
    if (!added.ok()) return added;
  }
  if (absl::Status signed_ok = Sign(cert->get(), ca_key->get()); !signed_ok.ok()) {
    return signed_ok;
  }
  return CertPem(cert->get());
}

// Host and port of "host:port" or "[v6]:port".
bool SplitAddress(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return !host->empty() && !port->empty();
}

// A TCP connection to `address` within `timeout`, or -1.
int ConnectTcp(const std::string& address, absl::Duration timeout, std::string* error) {
  std::string host, port;
  if (!SplitAddress(address, &host, &port)) {
    *error = absl::StrCat("'", address, "' is not HOST:PORT");
    return -1;
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    *error = absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
      *error = absl::StrCat("cannot connect to ", address, ": ", strerror(errno));
      close(fd);
      fd = -1;
      continue;
    }
    pollfd p{fd, POLLOUT, 0};
    int so_error = 0;
    socklen_t len = sizeof(so_error);
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1 ||
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0 || so_error != 0) {
      *error = absl::StrCat("cannot connect to ", address, ": ",
                            so_error != 0 ? strerror(so_error) : "timed out");
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd >= 0) {
    // Blocking from here, with socket timeouts as the deadline.
    const int flags = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    timeval tv{static_cast<time_t>(absl::ToInt64Seconds(timeout)),
               static_cast<suseconds_t>(absl::ToInt64Microseconds(timeout) % 1000000)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }
  return fd;
}

}  // namespace

absl::StatusOr<std::string> GeneratePrivateKeyPem() {
  absl::StatusOr<Key> key = NewKey();
  if (!key.ok()) return key.status();
  return KeyPem(key->get());
}

absl::StatusOr<CertifiedKey> CreateCertificateAuthority(const std::string& common_name,
                                                        absl::Duration validity) {
  absl::StatusOr<Key> key = NewKey();
  if (!key.ok()) return key.status();
  absl::StatusOr<Cert> cert =
      NewCertificate(key->get(), common_name, nullptr, key->get(), validity);
  if (!cert.ok()) return cert.status();
  for (auto [nid, value] : {std::pair<int, const char*>{NID_basic_constraints, "critical,CA:TRUE"},
                            {NID_key_usage, "critical,keyCertSign,cRLSign"},
                            {NID_subject_key_identifier, "hash"}}) {
    if (absl::Status added = AddExtension(cert->get(), cert->get(), nid, value); !added.ok()) {
      return added;
    }
  }
  if (absl::Status signed_ok = Sign(cert->get(), key->get()); !signed_ok.ok()) return signed_ok;
  return CertifiedKey{CertPem(cert->get()), KeyPem(key->get())};
}

absl::StatusOr<std::string> CreateCsrPem(const std::string& private_key_pem,
                                         const std::string& common_name) {
  absl::StatusOr<Key> key = ReadKey(private_key_pem);
  if (!key.ok()) return key.status();
  Req req(X509_REQ_new());
  X509_REQ_set_version(req.get(), 0);
  X509_NAME* name = X509_REQ_get_subject_name(req.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8,
                             reinterpret_cast<const unsigned char*>(common_name.c_str()), -1,
                             -1, 0);
  X509_REQ_set_pubkey(req.get(), key->get());
  if (X509_REQ_sign(req.get(), key->get(), EVP_sha256()) <= 0) return Failure("signing a CSR");
  Bio bio(BIO_new(BIO_s_mem()));
  PEM_write_bio_X509_REQ(bio.get(), req.get());
  return BioText(bio.get());
}

absl::StatusOr<Key> VerifiedCsrKey(const std::string& csr_pem) {
  if (csr_pem.size() > 16384) return absl::InvalidArgumentError("CSR larger than 16 KiB");
  Bio bio = MemoryBio(csr_pem);
  Req req(PEM_read_bio_X509_REQ(bio.get(), nullptr, nullptr, nullptr));
  if (req == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError("not a PEM certificate signing request");
  }
  Key key(X509_REQ_get_pubkey(req.get()));
  if (key == nullptr || X509_REQ_verify(req.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the CSR's signature does not verify with its own key");
  }
  return key;
}

absl::Status CheckCsr(const std::string& csr_pem) { return VerifiedCsrKey(csr_pem).status(); }

absl::StatusOr<std::string> IssueCertificateForCsr(const std::string& csr_pem,
                                                   const CertifiedKey& ca,
                                                   const IssueOptions& options) {
  absl::StatusOr<Key> key = VerifiedCsrKey(csr_pem);
  if (!key.ok()) return key.status();
  return IssueForKey(key->get(), ca, options);
}

absl::StatusOr<CertifiedKey> IssueCertifiedKey(const CertifiedKey& ca,
                                               const IssueOptions& options) {
  absl::StatusOr<Key> key = NewKey();
  if (!key.ok()) return key.status();
  absl::StatusOr<std::string> cert = IssueForKey(key->get(), ca, options);
  if (!cert.ok()) return cert.status();
  return CertifiedKey{*std::move(cert), KeyPem(key->get())};
}

absl::StatusOr<std::string> CertificateFingerprint(const std::string& certificate_pem) {
  absl::StatusOr<Cert> cert = ReadCert(certificate_pem);
  if (!cert.ok()) return cert.status();
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (X509_digest(cert->get(), EVP_sha256(), digest, &size) != 1) return Failure("digest");
  return absl::StrCat("sha256:", absl::BytesToHexString(absl::string_view(
                                     reinterpret_cast<const char*>(digest), size)));
}

absl::StatusOr<std::string> CertificateCommonName(const std::string& certificate_pem) {
  absl::StatusOr<Cert> cert = ReadCert(certificate_pem);
  if (!cert.ok()) return cert.status();
  char buffer[256] = {0};
  if (X509_NAME_get_text_by_NID(X509_get_subject_name(cert->get()), NID_commonName, buffer,
                                sizeof(buffer)) < 0) {
    return absl::InvalidArgumentError("certificate without a common name");
  }
  return std::string(buffer);
}

absl::StatusOr<absl::Time> CertificateNotAfter(const std::string& certificate_pem) {
  absl::StatusOr<Cert> cert = ReadCert(certificate_pem);
  if (!cert.ok()) return cert.status();
  tm when{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(cert->get()), &when) != 1) return Failure("notAfter");
  return absl::FromTM(when, absl::UTCTimeZone());
}

absl::Status VerifyIssuedBy(const std::string& certificate_pem, const std::string& ca_pem) {
  absl::StatusOr<Cert> cert = ReadCert(certificate_pem);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<Cert> ca = ReadCert(ca_pem);
  if (!ca.ok()) return ca.status();
  std::unique_ptr<X509_STORE, Deleter<X509_STORE, X509_STORE_free>> store(X509_STORE_new());
  X509_STORE_add_cert(store.get(), ca->get());
  std::unique_ptr<X509_STORE_CTX, Deleter<X509_STORE_CTX, X509_STORE_CTX_free>> ctx(
      X509_STORE_CTX_new());
  X509_STORE_CTX_init(ctx.get(), store.get(), cert->get(), nullptr);
  if (X509_verify_cert(ctx.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return absl::UnauthenticatedError(
        absl::StrCat("certificate not issued by this CA: ", X509_verify_cert_error_string(error)));
  }
  return absl::OkStatus();
}

absl::Status CheckKeyMatches(const std::string& certificate_pem,
                             const std::string& private_key_pem) {
  absl::StatusOr<Cert> cert = ReadCert(certificate_pem);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<Key> key = ReadKey(private_key_pem);
  if (!key.ok()) return key.status();
  if (X509_check_private_key(cert->get(), key->get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the private key does not belong to the certificate");
  }
  return absl::OkStatus();
}

std::vector<std::string> SplitPemBlocks(const std::string& bundle) {
  std::vector<std::string> blocks;
  size_t pos = 0;
  while ((pos = bundle.find("-----BEGIN ", pos)) != std::string::npos) {
    const size_t label_end = bundle.find("-----", pos + 11);
    if (label_end == std::string::npos) break;
    const std::string label = bundle.substr(pos + 11, label_end - pos - 11);
    const std::string end_marker = "-----END " + label + "-----";
    const size_t end = bundle.find(end_marker, label_end);
    if (end == std::string::npos) break;
    blocks.push_back(bundle.substr(pos, end + end_marker.size() - pos) + "\n");
    pos = end + end_marker.size();
  }
  return blocks;
}

absl::StatusOr<std::vector<std::string>> FetchServerCertificateChain(const std::string& address,
                                                                     absl::Duration timeout) {
  std::string error;
  const int fd = ConnectTcp(address, timeout, &error);
  if (fd < 0) return absl::UnavailableError(error);
  SslCtx ctx(SSL_CTX_new(TLS_client_method()));
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  // Nothing is verified here: the caller pins what it trusts.
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_NONE, nullptr);
  static const unsigned char kAlpn[] = {2, 'h', '2'};
  SSL_CTX_set_alpn_protos(ctx.get(), kAlpn, sizeof(kAlpn));
  Ssl ssl(SSL_new(ctx.get()));
  SSL_set_fd(ssl.get(), fd);
  const int connected = SSL_connect(ssl.get());
  std::vector<std::string> chain;
  if (connected == 1) {
    STACK_OF(X509)* certs = SSL_get_peer_cert_chain(ssl.get());
    for (int i = 0; certs != nullptr && i < sk_X509_num(certs); ++i) {
      chain.push_back(CertPem(sk_X509_value(certs, i)));
    }
    SSL_shutdown(ssl.get());
  }
  const std::string why = connected == 1 ? "" : OpenSslErrors();
  ssl.reset();
  close(fd);
  if (connected != 1) {
    return absl::UnavailableError(
        absl::StrCat("no TLS handshake with ", address, " (", why,
                     "); is it a geotrain coordinator started without --insecure?"));
  }
  if (chain.empty()) {
    return absl::UnavailableError(absl::StrCat(address, " presented no certificate"));
  }
  return chain;
}

absl::StatusOr<std::string> PinCertificateAuthority(const std::string& address,
                                                    const std::string& fingerprint,
                                                    absl::Duration timeout) {
  absl::StatusOr<std::vector<std::string>> chain = FetchServerCertificateChain(address, timeout);
  if (!chain.ok()) return chain.status();
  std::vector<std::string> seen;
  for (const std::string& pem : *chain) {
    absl::StatusOr<std::string> print = CertificateFingerprint(pem);
    if (!print.ok()) continue;
    if (*print == fingerprint && VerifyIssuedBy(chain->front(), pem).ok()) return pem;
    seen.push_back(*print);
  }
  return absl::UnauthenticatedError(
      absl::StrCat("the server at ", address, " presents no CA with fingerprint ", fingerprint,
                   " (it presents ", absl::StrJoin(seen, ", "),
                   "): this is not the coordinator the token was made for"));
}

}  // namespace geotrain
