// Mutual TLS over an already-connected socket, for links spliced by a
// geotrain-relay: the relay pairs two outbound TCP connections and copies
// bytes, and the two workers run TLS 1.3 end to end over them, so the relay
// can neither read nor alter what passes. Each side presents its worker
// certificate and requires the other's to chain to the cluster CA and to
// name the worker the plan put at the far end (as MakeSecureChannel does
// for direct links).
//
// Thread-safety: one reader and one writer may run at once (the pipeline
// driver sends while the link's reader reads). The socket is non-blocking
// and every OpenSSL call is made under one mutex, never while waiting, so
// the two never touch the SSL object together. Shutdown() is safe from any
// thread and makes blocked calls return.
#ifndef GEOTRAIN_COMMON_TLS_SESSION_H_
#define GEOTRAIN_COMMON_TLS_SESSION_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tcp_socket.h"
#include "common/transport_security.h"

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

namespace geotrain {

class TlsSession {
 public:
  enum class Role { kClient, kServer };

  // Runs the handshake within `timeout`. UNAUTHENTICATED naming what failed
  // (the peer's certificate does not chain to the cluster CA, has expired,
  // or names someone other than `expected_peer`).
  static absl::StatusOr<std::unique_ptr<TlsSession>> Establish(
      TcpSocket socket, Role role, const TransportSecurity& security,
      const std::string& expected_peer, absl::Duration timeout);
  ~TlsSession();

  // False once the session broke, timed out (`io_timeout` without
  // progress; infinite by default) or was shut down.
  bool WriteAll(const void* data, size_t size);
  bool ReadExactly(void* data, size_t size);
  void set_io_timeout(absl::Duration timeout) { io_timeout_ = timeout; }
  // Nothing to do: the caller's framing marks the end of its direction
  // (a close_notify could make the peer's last data be dropped).
  void CloseWrites();
  void Shutdown();
  const std::string& peer_identity() const { return peer_identity_; }
  const TcpSocket& socket() const { return socket_; }

 private:
  TlsSession() = default;
  // Waits until the socket is readable (`read`) or writable; false on
  // timeout, hang-up or shutdown.
  bool Wait(bool read, absl::Time deadline);
  // SSL_write (or SSL_read) until `size` bytes went, the timeout passed
  // without progress, or the session ended.
  bool Transfer(char* data, size_t size, bool write);

  TcpSocket socket_;
  SSL_CTX* ctx_ = nullptr;
  absl::Mutex mu_;
  SSL* ssl_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string peer_identity_;
  absl::Duration io_timeout_ = absl::InfiniteDuration();
  std::atomic<bool> shut_down_{false};
};

}  // namespace geotrain

#endif  // GEOTRAIN_COMMON_TLS_SESSION_H_
