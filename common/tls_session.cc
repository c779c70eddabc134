#include "common/tls_session.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <poll.h>

#include "absl/strings/str_cat.h"
#include "common/x509.h"

namespace geotrain {
namespace {

std::string OpenSslError() {
  std::string out;
  for (unsigned long e = ERR_get_error(); e != 0; e = ERR_get_error()) {
    char buffer[256];
    ERR_error_string_n(e, buffer, sizeof(buffer));
    absl::StrAppend(&out, out.empty() ? "" : "; ", buffer);
  }
  return out.empty() ? "no OpenSSL error queued" : out;
}

absl::Status UsePem(SSL_CTX* ctx, const TransportSecurity& security) {
  BIO* cert_bio = BIO_new_mem_buf(security.certificate_pem.data(),
                                  static_cast<int>(security.certificate_pem.size()));
  X509* cert = PEM_read_bio_X509(cert_bio, nullptr, nullptr, nullptr);
  BIO_free(cert_bio);
  BIO* key_bio = BIO_new_mem_buf(security.private_key_pem.data(),
                                 static_cast<int>(security.private_key_pem.size()));
  EVP_PKEY* key = PEM_read_bio_PrivateKey(key_bio, nullptr, nullptr, nullptr);
  BIO_free(key_bio);
  const bool ok = cert != nullptr && key != nullptr && SSL_CTX_use_certificate(ctx, cert) == 1 &&
                  SSL_CTX_use_PrivateKey(ctx, key) == 1;
  X509_free(cert);
  EVP_PKEY_free(key);
  if (!ok) return absl::InvalidArgumentError("this worker's certificate or key does not load");
  X509_STORE* store = SSL_CTX_get_cert_store(ctx);
  int trusted = 0;
  for (const std::string& pem : SplitPemBlocks(security.trusted_ca_pem)) {
    BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
    X509* ca = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
    BIO_free(bio);
    if (ca == nullptr) continue;
    trusted += X509_STORE_add_cert(store, ca) == 1 ? 1 : 0;
    X509_free(ca);
  }
  ERR_clear_error();
  if (trusted == 0) return absl::InvalidArgumentError("no cluster CA to verify peers with");
  return absl::OkStatus();
}

std::string CommonName(X509* cert) {
  char cn[256] = {0};
  const int n = X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, cn,
                                          sizeof(cn));
  return n > 0 ? std::string(cn, n) : "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsSession>> TlsSession::Establish(
    TcpSocket socket, Role role, const TransportSecurity& security,
    const std::string& expected_peer, absl::Duration timeout) {
  std::unique_ptr<TlsSession> session(new TlsSession());
  session->socket_ = std::move(socket);
  session->ctx_ = SSL_CTX_new(role == Role::kClient ? TLS_client_method() : TLS_server_method());
  if (session->ctx_ == nullptr) return absl::InternalError("SSL_CTX_new: " + OpenSslError());
  SSL_CTX_set_min_proto_version(session->ctx_, TLS1_3_VERSION);
  SSL_CTX_set_verify(session->ctx_, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  if (role == Role::kServer) SSL_CTX_set_num_tickets(session->ctx_, 0);
  if (absl::Status loaded = UsePem(session->ctx_, security); !loaded.ok()) return loaded;
  const int fd = session->socket_.fd();
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  const absl::Time deadline = absl::Now() + timeout;
  {
    absl::MutexLock lock(&session->mu_);
    session->ssl_ = SSL_new(session->ctx_);
    SSL_set_fd(session->ssl_, fd);
    if (role == Role::kClient) {
      SSL_set_connect_state(session->ssl_);
    } else {
      SSL_set_accept_state(session->ssl_);
    }
  }
  while (true) {
    int rc, error;
    {
      absl::MutexLock lock(&session->mu_);
      ERR_clear_error();  // SSL_get_error reads this thread's queue
      rc = SSL_do_handshake(session->ssl_);
      error = rc == 1 ? SSL_ERROR_NONE : SSL_get_error(session->ssl_, rc);
    }
    if (rc == 1) break;
    if ((error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) &&
        session->Wait(error == SSL_ERROR_WANT_READ, deadline)) {
      continue;
    }
    long verify;
    {
      absl::MutexLock lock(&session->mu_);
      verify = SSL_get_verify_result(session->ssl_);
    }
    ERR_clear_error();
    if (verify != X509_V_OK) {
      return absl::UnauthenticatedError(absl::StrCat(
          "TLS handshake with ", session->socket_.PeerName(), " failed: its certificate ",
          verify == X509_V_ERR_CERT_HAS_EXPIRED ? "has expired"
                                                 : X509_verify_cert_error_string(verify),
          " (it must be a certificate of this cluster's CA)"));
    }
    return absl::UnavailableError(absl::StrCat(
        "TLS handshake with ", session->socket_.PeerName(), " failed",
        absl::Now() >= deadline ? absl::StrCat(": no answer within ", absl::FormatDuration(timeout))
                                : absl::StrCat(": ", OpenSslError())));
  }
  X509* peer;
  {
    absl::MutexLock lock(&session->mu_);
    peer = SSL_get1_peer_certificate(session->ssl_);
  }
  if (peer == nullptr) return absl::UnauthenticatedError("the peer presented no certificate");
  session->peer_identity_ = CommonName(peer);
  X509_free(peer);
  if (session->peer_identity_ != expected_peer) {
    return absl::UnauthenticatedError(absl::StrCat(
        "the peer's certificate names '", session->peer_identity_.substr(0, 128), "', not '",
        expected_peer, "' whom the plan put at the far end of this link"));
  }
  return session;
}

TlsSession::~TlsSession() {
  {
    absl::MutexLock lock(&mu_);
    if (ssl_ != nullptr) SSL_free(ssl_);
    ssl_ = nullptr;
  }
  if (ctx_ != nullptr) SSL_CTX_free(ctx_);
}

bool TlsSession::Wait(bool read, absl::Time deadline) {
  while (!shut_down_) {
    pollfd p{socket_.fd(), static_cast<short>(read ? POLLIN : POLLOUT), 0};
    int64_t ms = 1000;  // wake now and then to notice Shutdown()
    if (deadline != absl::InfiniteFuture()) {
      ms = std::min<int64_t>(ms, absl::ToInt64Milliseconds(deadline - absl::Now()));
      if (ms <= 0) return false;
    }
    const int rc = poll(&p, 1, static_cast<int>(ms));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) return false;
    if (rc == 0) continue;
    if (p.revents & (POLLERR | POLLNVAL)) return false;
    return true;  // readable, writable or hung up: the SSL call says which
  }
  return false;
}

bool TlsSession::WriteAll(const void* data, size_t size) {
  return Transfer(const_cast<char*>(static_cast<const char*>(data)), size, /*write=*/true);
}

bool TlsSession::ReadExactly(void* data, size_t size) {
  return Transfer(static_cast<char*>(data), size, /*write=*/false);
}

bool TlsSession::Transfer(char* p, size_t size, bool write) {
  absl::Time deadline =
      io_timeout_ == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + io_timeout_;
  while (size > 0) {
    if (shut_down_) return false;
    int rc, error;
    {
      absl::MutexLock lock(&mu_);
      ERR_clear_error();
      const int n = static_cast<int>(std::min<size_t>(size, 1 << 20));
      rc = write ? SSL_write(ssl_, p, n) : SSL_read(ssl_, p, n);
      error = rc > 0 ? SSL_ERROR_NONE : SSL_get_error(ssl_, rc);
    }
    if (rc > 0) {
      p += rc;
      size -= static_cast<size_t>(rc);
      if (io_timeout_ != absl::InfiniteDuration()) deadline = absl::Now() + io_timeout_;
      continue;
    }
    // Either direction may need the other first (renegotiation, a key update).
    if ((error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) &&
        Wait(error == SSL_ERROR_WANT_READ, deadline)) {
      continue;
    }
    ERR_clear_error();
    return false;  // close_notify, a reset, a timeout or Shutdown()
  }
  return true;
}

void TlsSession::CloseWrites() {
  // Nothing at the TLS level: after close_notify, or a TCP half-close under
  // TLS, what the peer still sends may be lost. The framing's end marker
  // (link_transport.cc) is the end of this direction.
}

void TlsSession::Shutdown() {
  shut_down_ = true;
  socket_.Shutdown();
}

}  // namespace geotrain
