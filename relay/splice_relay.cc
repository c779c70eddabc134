#include "relay/splice_relay.h"

#include <poll.h>
#include <sys/socket.h>

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/join_token.h"
#include "common/logging.h"
#include "common/rpc_options.h"

namespace geotrain {
namespace {

constexpr char kGreeting[] = "GTRELAY1";

bool IsRendezvous(const std::string& s) {
  if (s.size() != 32) return false;
  for (char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// Whether the peer of a connection that sent nothing since its greeting
// has closed it (or it broke): a waiting end that is gone.
bool PeerGone(const TcpSocket& socket) {
  pollfd p{socket.fd(), POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  char byte;
  return (p.revents & POLLIN) && recv(socket.fd(), &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

void Answer(TcpSocket& socket, const std::string& line) {
  const std::string out = line + "\n";
  socket.WriteAll(out.data(), out.size());
}

}  // namespace

absl::StatusOr<std::unique_ptr<SpliceRelay>> SpliceRelay::Start(SpliceRelayOptions options) {
  std::unique_ptr<SpliceRelay> relay(new SpliceRelay(std::move(options)));
  absl::StatusOr<TcpListener> listener = TcpListener::Listen(relay->options_.listen);
  if (!listener.ok()) return listener.status();
  relay->port_ = listener->port();
  relay->listener_ = std::make_unique<TcpListener>(*std::move(listener));
  SpliceRelay* raw = relay.get();
  relay->acceptor_ = std::thread([raw] { raw->AcceptLoop(); });
  return relay;
}

SpliceRelay::~SpliceRelay() {
  Shutdown();
  if (acceptor_.joinable()) acceptor_.join();
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return handlers_ == 0; };
  mu_.Await(absl::Condition(&idle));
}

void SpliceRelay::SetIdentity(const std::string& id) {
  absl::MutexLock lock(&mu_);
  identity_ = id;
}

void SpliceRelay::SetLinks(std::map<std::string, Proofs> links) {
  absl::MutexLock lock(&mu_);
  links_ = std::move(links);
}

void SpliceRelay::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return;
  shutdown_ = true;
  listener_->Shutdown();
  for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
}

SpliceRelayStats SpliceRelay::stats() const {
  absl::MutexLock lock(&mu_);
  SpliceRelayStats out = stats_;
  out.waiting = static_cast<int>(waiting_.size());
  out.bytes_spliced = bytes_.load();
  return out;
}

void SpliceRelay::AcceptLoop() {
  const int max_handlers = options_.max_waiting + 2 * options_.max_pairs + 64;
  while (true) {
    absl::StatusOr<TcpSocket> socket = listener_->Accept();
    if (!socket.ok()) return;  // shut down
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    if (handlers_ >= max_handlers) {
      ++stats_.refused;
      continue;  // closes it: the relay is full
    }
    ++handlers_;
    open_.insert(socket->fd());
    std::thread([this, s = *std::move(socket)]() mutable { Handle(std::move(s)); }).detach();
  }
}

void SpliceRelay::Handle(TcpSocket socket) {
  // Ends this handler: forgets `fds` (whose sockets close right after).
  auto finish = [this](std::vector<int> fds) {
    absl::MutexLock lock(&mu_);
    for (int fd : fds) open_.erase(fd);
    --handlers_;
  };
  socket.SetKeepalive(options_.keepalive_idle, options_.keepalive_interval);
  socket.SetTimeouts(options_.greeting_timeout, options_.greeting_timeout);
  const std::string peer = socket.PeerName();
  absl::StatusOr<std::string> line =
      socket.ReadLine(256, absl::Now() + options_.greeting_timeout);
  std::vector<std::string> words =
      line.ok() ? absl::StrSplit(*line, ' ', absl::SkipEmpty()) : std::vector<std::string>();
  if (words.size() == 2 && words[0] == kGreeting && words[1] == "probe") {
    std::string id;
    {
      absl::MutexLock lock(&mu_);
      id = identity_;
    }
    Answer(socket, absl::StrCat(kGreeting, " relay ", id.empty() ? "-" : id));
    return finish({socket.fd()});
  }
  if (words.size() != 4 || words[0] != kGreeting || !IsRendezvous(words[1]) ||
      (words[2] != "up" && words[2] != "down") || !IsRendezvous(words[3])) {
    {
      absl::MutexLock lock(&mu_);
      ++stats_.refused;
    }
    // What was wrong, without echoing what may be a secret.
    GT_LOG(Warning) << "refused " << peer << ": "
                    << (line.ok() ? absl::StrCat("not a relay greeting (", words.size(),
                                                 " words; expected 4)")
                                  : std::string(line.status().message()));
    Answer(socket, "ERR expected 'GTRELAY1 <32 hex rendezvous> up|down <32 hex proof>'");
    return finish({socket.fd()});
  }
  const std::string& rendezvous = words[1];
  const std::string side = words[2];
  const std::string key = rendezvous + "/" + side;
  const std::string other_key = rendezvous + "/" + (side == "up" ? "down" : "up");
  const std::string source = PeerHost(peer);
  TcpSocket partner;
  std::string refusal;  // set: answer ERR and end
  {
    absl::MutexLock lock(&mu_);
    auto known = [this, &rendezvous]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shutdown_ || links_.count(rendezvous) > 0;
    };
    auto other = waiting_.end();
    const bool is_known =
        mu_.AwaitWithTimeout(absl::Condition(&known), options_.unknown_rendezvous_wait) &&
        !shutdown_;
    // Ends whose connection closed while they waited are no partners, and
    // hold no place: they are gone.
    for (const std::string& k : {key, other_key}) {
      if (auto it = waiting_.find(k); it != waiting_.end() && !it->second->paired &&
                                      PeerGone(*it->second->socket)) {
        it->second->gone = true;
        waiting_.erase(it);
      }
    }
    if (!is_known) {
      refusal = "no link of the current plan goes through this relay with that rendezvous";
    } else if (const Proofs& proofs = links_.at(rendezvous); !ConstantTimeEquals(
                   words[3], side == "up" ? proofs.up : proofs.down)) {
      refusal = absl::StrCat("wrong proof for the ", side, " end of that link");
    } else if (auto twin = waiting_.find(key); twin != waiting_.end() && !twin->second->paired) {
      // The first end stays; a second one with the same secrets is a copy
      // of that worker's key (or a bug).
      refusal = absl::StrCat("the ", side, " end of that link is already waiting here "
                             "(its worker's key may be in use twice)");
    } else if (other = waiting_.find(other_key);
               other != waiting_.end() && !other->second->paired) {
      if (stats_.pairs_open >= options_.max_pairs) {
        refusal = absl::StrCat("this relay splices ", options_.max_pairs, " links already");
      } else {
        // The other end waits: it splices, with this connection as its partner.
        Waiting* waiter = other->second;
        waiter->paired = true;
        waiter->partner = std::move(socket);
        waiting_.erase(other);
        ++stats_.pairs_open;
        ++stats_.pairs_total;
        --handlers_;  // the socket (and its fd in open_) belongs to the waiter now
        return;
      }
    } else if (static_cast<int>(waiting_.size()) >= options_.max_waiting ||
               waiting_per_source_[source] >= options_.max_waiting_per_source) {
      refusal = absl::StrCat("too many ends waiting for their pair (",
                             options_.max_waiting_per_source, " per source, ",
                             options_.max_waiting, " in all)");
      if (waiting_per_source_[source] == 0) waiting_per_source_.erase(source);
    } else {
      Waiting me;
      me.source = source;
      me.socket = &socket;
      waiting_[key] = &me;
      ++waiting_per_source_[source];
      auto done = [this, &me]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return me.paired || me.gone || shutdown_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&done), options_.pair_timeout);
      if (auto it = waiting_.find(key); it != waiting_.end() && it->second == &me) {
        waiting_.erase(it);
      }
      if (--waiting_per_source_[source] == 0) waiting_per_source_.erase(source);
      if (me.paired) {
        partner = std::move(me.partner);
      } else {
        refusal = me.gone ? "this connection was closed while it waited"
                          : absl::StrCat("the other end did not arrive within ",
                                         absl::FormatDuration(options_.pair_timeout));
      }
    }
    if (!refusal.empty()) ++stats_.refused;
  }
  if (!refusal.empty()) {
    GT_LOG(Warning) << "refused " << peer << ": " << refusal;
    Answer(socket, "ERR " + refusal);
    return finish({socket.fd()});
  }
  GT_LOG(Info) << "paired " << peer << " with " << partner.PeerName() << " ("
               << rendezvous.substr(0, 8) << "...)";
  socket.SetTimeouts(absl::InfiniteDuration(), absl::InfiniteDuration());
  partner.SetTimeouts(absl::InfiniteDuration(), absl::InfiniteDuration());
  Answer(socket, "OK");
  Answer(partner, "OK");
  Splice(socket, partner);
  // Forgotten before they close, so that Shutdown() never touches a
  // descriptor number the kernel has given to a new connection.
  absl::MutexLock lock(&mu_);
  open_.erase(socket.fd());
  open_.erase(partner.fd());
  --stats_.pairs_open;
  --handlers_;
}

void SpliceRelay::Splice(TcpSocket& a, TcpSocket& b) {
  // One direction: copies until end of stream (then half-closes the
  // other leg) or an error (then ends both).
  auto pump = [this](TcpSocket& from, TcpSocket& to) {
    std::vector<char> buffer(options_.buffer_bytes);
    while (true) {
      const long n = from.ReadSome(buffer.data(), buffer.size());
      if (n == 0) {
        to.ShutdownWrites();
        return;
      }
      if (n < 0 || !to.WriteAll(buffer.data(), static_cast<size_t>(n))) {
        from.Shutdown();
        to.Shutdown();
        return;
      }
      bytes_ += static_cast<uint64_t>(n);
    }
  };
  std::thread back([&] { pump(b, a); });
  pump(a, b);
  back.join();
}

}  // namespace geotrain
