#include "common/tcp_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace geotrain {
namespace {

// "host:port" or "[v6]:port" -> host, port.
absl::Status SplitAddress(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  int number = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &number) || number < 0 || number > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' is not HOST:PORT"));
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  *port = address.substr(colon + 1);
  return absl::OkStatus();
}

timeval DurationToTimeval(absl::Duration d) {
  timeval tv{0, 0};  // zero: no timeout
  if (d == absl::InfiniteDuration() || d <= absl::ZeroDuration()) return tv;
  const int64_t us = absl::ToInt64Microseconds(d);
  tv.tv_sec = us / 1000000;
  tv.tv_usec = us % 1000000;
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1;
  return tv;
}

std::string NameOf(const sockaddr* addr) {
  char host[INET6_ADDRSTRLEN] = {0};
  if (addr->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return absl::StrCat("ipv4:", host, ":", ntohs(in->sin_port));
  }
  if (addr->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    return absl::StrCat("ipv6:[", host, "]:", ntohs(in6->sin6_port));
  }
  return "unknown";
}

}  // namespace

TcpSocket& TcpSocket::operator=(TcpSocket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.release();
  }
  return *this;
}

TcpSocket::~TcpSocket() {
  if (fd_ >= 0) close(fd_);
}

int TcpSocket::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

absl::StatusOr<TcpSocket> TcpSocket::Connect(const std::string& address,
                                             absl::Duration timeout) {
  std::string host, port;
  if (absl::Status split = SplitAddress(address, &host, &port); !split.ok()) return split;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_family = AF_UNSPEC;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", address, ": ", gai_strerror(rc)));
  }
  const absl::Time deadline = absl::Now() + timeout;
  std::string last_error = "no address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    TcpSocket socket(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!socket.valid()) {
      last_error = strerror(errno);
      continue;
    }
    const int flags = fcntl(socket.fd(), F_GETFL);
    fcntl(socket.fd(), F_SETFL, flags | O_NONBLOCK);
    int rc = ::connect(socket.fd(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{socket.fd(), POLLOUT, 0};
      const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
      rc = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
      if (rc == 0) {
        last_error = absl::StrCat("no answer within ", absl::FormatDuration(timeout),
                                  " (a firewall dropping packets, or no host there)");
        continue;
      }
      int error = 0;
      socklen_t length = sizeof(error);
      getsockopt(socket.fd(), SOL_SOCKET, SO_ERROR, &error, &length);
      rc = error == 0 ? 0 : -1;
      errno = error;
    }
    if (rc != 0) {
      last_error = errno == ECONNREFUSED
                       ? "connection refused (nothing listens on that port, or a firewall rejects it)"
                       : strerror(errno);
      continue;
    }
    fcntl(socket.fd(), F_SETFL, flags);
    freeaddrinfo(found);
    int one = 1;
    setsockopt(socket.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return socket;
  }
  freeaddrinfo(found);
  return absl::UnavailableError(absl::StrCat("cannot connect to ", address, ": ", last_error));
}

void TcpSocket::SetTimeouts(absl::Duration read, absl::Duration write) {
  const timeval r = DurationToTimeval(read), w = DurationToTimeval(write);
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &r, sizeof(r));
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &w, sizeof(w));
}

void TcpSocket::SetKeepalive(absl::Duration idle, absl::Duration interval) {
  int one = 1;
  setsockopt(fd_, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle_s = std::max<int>(1, absl::ToInt64Seconds(idle));
  int interval_s = std::max<int>(1, absl::ToInt64Seconds(interval));
  int count = 3;
  setsockopt(fd_, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  setsockopt(fd_, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  setsockopt(fd_, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

bool TcpSocket::WriteAll(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd_, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

long TcpSocket::ReadSome(void* data, size_t size) {
  while (true) {
    const ssize_t n = ::recv(fd_, data, size, 0);
    if (n < 0 && errno == EINTR) continue;
    return n < 0 ? -1 : static_cast<long>(n);
  }
}

bool TcpSocket::ReadExactly(void* data, size_t size) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const long n = ReadSome(p, size);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

absl::StatusOr<std::string> TcpSocket::ReadLine(size_t max_bytes, absl::Time deadline) {
  std::string line;
  char c = 0;
  while (true) {
    if (absl::Now() > deadline) return absl::DeadlineExceededError("no full line in time");
    const long n = ReadSome(&c, 1);  // byte by byte: nothing past the line is consumed
    if (n == 0) return absl::UnavailableError("connection closed before a full line");
    if (n < 0) return absl::DeadlineExceededError("no full line in time");
    if (c == '\n') return line;
    if (line.size() >= max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("line longer than ", max_bytes, " bytes"));
    }
    line.push_back(c);
  }
}

void TcpSocket::Shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void TcpSocket::ShutdownWrites() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_WR);
}

std::string TcpSocket::PeerName() const {
  sockaddr_storage addr{};
  socklen_t length = sizeof(addr);
  if (getpeername(fd_, reinterpret_cast<sockaddr*>(&addr), &length) != 0) return "unknown";
  return NameOf(reinterpret_cast<const sockaddr*>(&addr));
}

absl::StatusOr<TcpListener> TcpListener::Listen(const std::string& address, int backlog) {
  std::string host, port;
  if (absl::Status split = SplitAddress(address, &host, &port); !split.ok()) return split;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_family = AF_UNSPEC;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const char* node = host.empty() || host == "0.0.0.0" ? nullptr : host.c_str();
  if (int rc = getaddrinfo(node, port.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve ", address, ": ", gai_strerror(rc)));
  }
  std::string last_error = "no address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    if (node == nullptr && ai->ai_family != AF_INET) continue;  // 0.0.0.0 means IPv4
    TcpSocket socket(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!socket.valid()) continue;
    int one = 1;
    setsockopt(socket.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(socket.fd(), ai->ai_addr, ai->ai_addrlen) != 0 ||
        ::listen(socket.fd(), backlog) != 0) {
      last_error = strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&bound), &length);
    TcpListener listener;
    listener.port_ = bound.ss_family == AF_INET
                         ? ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port)
                         : ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
    listener.socket_ = std::move(socket);
    freeaddrinfo(found);
    return listener;
  }
  freeaddrinfo(found);
  return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", last_error));
}

absl::StatusOr<TcpSocket> TcpListener::Accept() {
  while (true) {
    const int fd = ::accept4(socket_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) return TcpSocket(fd);
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EMFILE || errno == ENFILE) {
      absl::SleepFor(absl::Milliseconds(100));  // out of descriptors: wait, do not spin
      continue;
    }
    return absl::UnavailableError(absl::StrCat("accept: ", strerror(errno)));
  }
}

void TcpListener::Shutdown() { socket_.Shutdown(); }

}  // namespace geotrain
