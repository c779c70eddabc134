#include "deploy/wan-lab/tcp_relay.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace geotrain::wanlab {
namespace {

constexpr size_t kChunkBytes = 16 * 1024;

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string ErrnoText() { return std::strerror(errno); }

absl::StatusOr<sockaddr_in> Resolve(const std::string& address) {
  auto host_port = SplitHostPort(address);
  if (!host_port.ok()) return host_port.status();
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(host_port->second));
  const std::string& host = host_port->first;
  if (host.empty() || host == "0.0.0.0") {
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
  } else if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("cannot resolve host '", host, "'"));
    }
    addr.sin_addr = reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr;
    freeaddrinfo(found);
  }
  return addr;
}

void SetBuffers(int fd, int bytes) {
  if (bytes <= 0) return;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

void TcpRelay::SetShape(const LinkShape& shape) {
  {
    std::lock_guard<std::mutex> lock(shape_mu_);
    shape_ = shape;
  }
  ++shape_generation_;
}

LinkShape TcpRelay::shape() const {
  std::lock_guard<std::mutex> lock(shape_mu_);
  return shape_;
}

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not HOST:PORT"));
  }
  return std::make_pair(address.substr(0, colon), port);
}

// One relayed connection: two directions, each a reader that admits chunks
// through its shaper and a writer that delivers them when they are due.
class TcpRelay::Connection {
 public:
  Connection(TcpRelay* relay, int client_fd, int target_fd)
      : relay_(relay), fds_{client_fd, target_fd} {
    for (int d = 0; d < 2; ++d) {
      // The generation first: a SetShape in between is then seen at the
      // first chunk rather than missed.
      directions_[d].generation = relay->shape_generation_.load();
      directions_[d].shaper = std::make_unique<LinkShaper>(relay->shape());
      directions_[d].from = fds_[d];
      directions_[d].to = fds_[1 - d];
    }
    for (int d = 0; d < 2; ++d) {
      threads_.emplace_back([this, d] { ReadLoop(&directions_[d]); });
      threads_.emplace_back([this, d] { WriteLoop(&directions_[d]); });
    }
  }

  ~Connection() {
    Abort();
    for (std::thread& thread : threads_) thread.join();
    for (int fd : fds_) {
      // Reset rather than linger: a relay that drops a link drops it now.
      const linger hard{1, 0};
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
      close(fd);
    }
  }

  // Unblocks every thread; both ends see the connection end.
  void Abort() {
    if (aborted_.exchange(true)) return;
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    for (Direction& direction : directions_) {
      std::lock_guard<std::mutex> lock(direction.mu);
      direction.cv.notify_all();
    }
  }

  bool finished() const { return writers_done_.load() == 2 && readers_done_.load() == 2; }

 private:
  struct Chunk {
    std::vector<char> bytes;  // empty: end of stream
    int64_t deliver_at_us;
  };
  struct Direction {
    std::unique_ptr<LinkShaper> shaper;  // its reader's alone
    int64_t generation = 0;              // of the relay's shape it follows
    int from = -1, to = -1;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Chunk> queue;  // guarded by mu
  };

  void Push(Direction* direction, Chunk chunk) {
    std::lock_guard<std::mutex> lock(direction->mu);
    direction->queue.push_back(std::move(chunk));
    direction->cv.notify_all();
  }

  void ReadLoop(Direction* direction) {
    std::vector<char> buffer(kChunkBytes);
    while (!aborted_) {
      const ssize_t got = recv(direction->from, buffer.data(), buffer.size(), 0);
      if (got <= 0) {
        if (got < 0 && errno == EINTR) continue;
        // A blackhole swallows the close too: the other end never hears of it.
        if (relay_->blackhole_) break;
        if (got < 0) Abort();
        Push(direction, Chunk{{}, NowUs()});  // end of stream after what is queued
        break;
      }
      if (relay_->blackhole_) {
        relay_->bytes_dropped_ += got;
        continue;
      }
      if (const int64_t now = relay_->shape_generation_.load(); now != direction->generation) {
        direction->generation = now;
        direction->shaper->SetShape(relay_->shape());
      }
      // Queue cap: wait (without reading more) until the backlog has room.
      for (int64_t wait = direction->shaper->AdmitWaitUs(NowUs(), got); wait > 0 && !aborted_;
           wait = direction->shaper->AdmitWaitUs(NowUs(), got)) {
        std::unique_lock<std::mutex> lock(direction->mu);
        direction->cv.wait_for(lock, std::chrono::microseconds(wait),
                               [this] { return aborted_.load(); });
      }
      const int64_t deliver_at = direction->shaper->Admit(NowUs(), got);
      Push(direction, Chunk{std::vector<char>(buffer.begin(), buffer.begin() + got), deliver_at});
    }
    readers_done_++;
  }

  void WriteLoop(Direction* direction) {
    const int64_t limit = relay_->options_.close_after_bytes;
    while (true) {
      Chunk chunk;
      {
        std::unique_lock<std::mutex> lock(direction->mu);
        direction->cv.wait(lock, [&] { return aborted_ || !direction->queue.empty(); });
        if (aborted_) break;
        // Delivery times never decrease, so the front is always due first.
        const auto due = std::chrono::steady_clock::time_point(
            std::chrono::microseconds(direction->queue.front().deliver_at_us));
        if (direction->cv.wait_until(lock, due, [this] { return aborted_.load(); })) break;
        chunk = std::move(direction->queue.front());
        direction->queue.pop_front();
      }
      if (chunk.bytes.empty()) {
        if (!relay_->blackhole_) shutdown(direction->to, SHUT_WR);
        break;
      }
      if (relay_->blackhole_) {
        relay_->bytes_dropped_ += static_cast<int64_t>(chunk.bytes.size());
        continue;
      }
      size_t length = chunk.bytes.size();
      bool close_after = false;
      if (limit > 0) {
        const int64_t before = forwarded_.fetch_add(static_cast<int64_t>(length));
        if (before + static_cast<int64_t>(length) >= limit) {
          length = static_cast<size_t>(std::max<int64_t>(0, limit - before));
          close_after = true;
        }
      }
      size_t offset = 0;
      while (offset < length) {
        const ssize_t put = send(direction->to, chunk.bytes.data() + offset, length - offset,
                                 MSG_NOSIGNAL);
        if (put < 0 && errno == EINTR) continue;
        if (put <= 0) break;
        offset += static_cast<size_t>(put);
      }
      relay_->bytes_forwarded_ += static_cast<int64_t>(offset);
      if (offset < length || close_after) {
        if (close_after) GT_LOG(Info) << "closing a connection after " << limit << " bytes";
        Abort();
        break;
      }
    }
    writers_done_++;
  }

  TcpRelay* relay_;
  int fds_[2];
  Direction directions_[2];  // [0]: client -> target, [1]: target -> client
  std::vector<std::thread> threads_;
  std::atomic<bool> aborted_{false};
  std::atomic<int64_t> forwarded_{0};
  std::atomic<int> readers_done_{0};
  std::atomic<int> writers_done_{0};
};

TcpRelay::TcpRelay(RelayOptions options)
    : options_(std::move(options)), shape_(options_.shape), blackhole_(options_.blackhole) {}

TcpRelay::~TcpRelay() { Stop(); }

absl::StatusOr<int> TcpRelay::Start() {
  auto target = Resolve(options_.target);
  if (!target.ok()) return target.status();
  auto listen_addr = Resolve(options_.listen);
  if (!listen_addr.ok()) return listen_addr.status();
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", ErrnoText()));
  const int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  SetBuffers(listen_fd_, options_.socket_buffer_bytes);  // inherited by accepted sockets
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&*listen_addr), sizeof(*listen_addr)) != 0 ||
      listen(listen_fd_, 64) != 0) {
    const std::string why = ErrnoText();
    close(listen_fd_);
    listen_fd_ = -1;
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen, ": ", why));
  }
  sockaddr_in bound{};
  socklen_t length = sizeof(bound);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return static_cast<int>(ntohs(bound.sin_port));
}

void TcpRelay::AcceptLoop() {
  const sockaddr_in target = *Resolve(options_.target);
  while (!stopping_) {
    pollfd poll_fd{listen_fd_, POLLIN, 0};
    const int ready = poll(&poll_fd, 1, 200);
    ReapFinished();
    if (ready <= 0) continue;
    const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    const int upstream = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    SetBuffers(upstream, options_.socket_buffer_bytes);
    if (connect(upstream, reinterpret_cast<const sockaddr*>(&target), sizeof(target)) != 0) {
      GT_LOG(Warning) << "cannot reach target " << options_.target << ": " << ErrnoText()
                      << "; dropping the client";
      close(upstream);
      close(client);
      continue;
    }
    connections_total_++;
    std::lock_guard<std::mutex> lock(mu_);
    connections_.push_back(std::make_unique<Connection>(this, client, upstream));
  }
}

void TcpRelay::ReapFinished() {
  std::list<std::unique_ptr<Connection>> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      if ((*it)->finished()) {
        finished.push_back(std::move(*it));
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Destructors join threads; done outside the lock.
}

void TcpRelay::Stop() {
  if (stopping_.exchange(true)) return;
  if (accept_thread_.joinable()) accept_thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
  std::list<std::unique_ptr<Connection>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(connections_);
  }
  all.clear();
}

RelayTotals TcpRelay::totals() const {
  return RelayTotals{connections_total_.load(), bytes_forwarded_.load(), bytes_dropped_.load()};
}

}  // namespace geotrain::wanlab
