// net/gate.hpp: admitting connections without ever waiting on one.
//
// An epoll instance holds the listener and every connection in its handshake; the owner polls that
// instance's descriptor. Handshakes are kept in arrival order too, which is also the order of
// their deadlines (they all get the same time), so pushing out the oldest and expiring the late
// both take from the front.
#include "net/gate.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "kolo/status.hpp"

namespace kolo::net {
namespace {

constexpr uint64_t kListenerId = 0;
// Connections accepted per advance(): a flood of connections cannot starve the answers of those
// already in their handshake.
constexpr int kAcceptBatch = 64;
constexpr uint32_t kWarningBurst = 5;
constexpr auto kWarningPeriod = std::chrono::seconds(10);
// While accept() fails for want of descriptors or memory, the listener rests this long.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);

std::string system_text(int error) { return std::generic_category().message(error); }

int ms_until(Clock::time_point when) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(when - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
}

}  // namespace

Gate::Gate(Socket listener, std::string secret, std::string name, Check check, GateLimits limits)
    : listener_(std::move(listener)),
      epoll_(::epoll_create1(EPOLL_CLOEXEC)),
      secret_(std::move(secret)),
      name_(std::move(name)),
      check_(std::move(check)),
      limits_(limits),
      warnings_(kWarningBurst, kWarningPeriod) {
  limits_.pending = std::max<size_t>(limits_.pending, 1);
  if (!epoll_.valid()) {
    throw Error(Status::kSystem, fmt::format("{}: epoll_create1: {}", name_, system_text(errno)));
  }
  set_nonblocking(listener_, true);
  endpoint_ = local_endpoint(listener_);
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = kListenerId;
  if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, listener_.fd(), &event) != 0) {
    throw Error(Status::kSystem, fmt::format("{}: epoll_ctl: {}", name_, system_text(errno)));
  }
}

Gate::~Gate() { report_held_back(true); }

int Gate::timeout_ms() const {
  auto wake_at = warnings_.report_due();
  if (!arrivals_.empty()) wake_at = std::min(wake_at, arrivals_.front().first);
  if (accept_paused_) wake_at = std::min(wake_at, accept_resume_);
  return wake_at == Clock::time_point::max() ? -1 : ms_until(wake_at);
}

std::vector<Gate::Admitted> Gate::advance() {
  std::vector<Admitted> admitted;
  epoll_event events[64];
  const int ready = ::epoll_wait(epoll_.fd(), events, 64, 0);
  for (int i = 0; i < ready; ++i) {
    const uint64_t id = events[i].data.u64;
    if (id == kListenerId) {
      accept_ready();
      continue;
    }
    auto it = pending_.find(id);
    if (it != pending_.end()) read_answer(id, it->second, admitted);
  }
  expire();
  if (accept_paused_ && Clock::now() >= accept_resume_) {
    accept_paused_ = false;
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.u64 = kListenerId;
    ::epoll_ctl(epoll_.fd(), EPOLL_CTL_MOD, listener_.fd(), &event);
  }
  report_held_back(false);
  stats_.pending = pending_.size();
  return admitted;
}

void Gate::accept_ready() {
  for (int i = 0; i < kAcceptBatch; ++i) {
    Socket socket(::accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (socket.valid()) {
      start(std::move(socket));
      continue;
    }
    const int error = errno;
    if (error == EAGAIN || error == EWOULDBLOCK) return;
    if (error == EINTR || error == ECONNABORTED || error == EPROTO) continue;
    // Out of descriptors or memory: rest instead of spinning on a listener that stays readable.
    warn("{} at {}: cannot accept connections ({}); retrying", name_, endpoint_.to_string(),
         system_text(error));
    accept_paused_ = true;
    accept_resume_ = Clock::now() + kAcceptPause;
    epoll_event event{};
    event.data.u64 = kListenerId;
    ::epoll_ctl(epoll_.fd(), EPOLL_CTL_MOD, listener_.fd(), &event);
    return;
  }
}

void Gate::start(Socket socket) {
  while (pending_.size() >= limits_.pending && !arrivals_.empty()) {
    const uint64_t oldest = arrivals_.front().second;
    arrivals_.pop_front();
    if (pending_.count(oldest)) {
      drop(oldest, fmt::format("{} connections were already proving the job secret (the limit); "
                               "this was the oldest",
                               limits_.pending));
    }
  }
  Handshake handshake;
  try {
    handshake.peer = peer_endpoint(socket).to_string();
  } catch (const Error&) {
    ++stats_.dropped;  // reset while it waited in the backlog: nobody to warn about
    return;
  }
  set_nodelay(socket);
  handshake.nonce = make_auth_nonce();
  // The first bytes on a fresh connection: its send buffer takes them whole.
  if (::send(socket.fd(), handshake.nonce.data(), handshake.nonce.size(),
             MSG_DONTWAIT | MSG_NOSIGNAL) != static_cast<ssize_t>(handshake.nonce.size())) {
    ++stats_.dropped;
    warn("{}: dropped a connection from {}: it could not take the challenge", name_,
         handshake.peer);
    return;
  }
  const uint64_t id = next_id_++;
  epoll_event event{};
  event.events = EPOLLIN | EPOLLRDHUP;
  event.data.u64 = id;
  if (::epoll_ctl(epoll_.fd(), EPOLL_CTL_ADD, socket.fd(), &event) != 0) {
    throw Error(Status::kSystem, fmt::format("{}: epoll_ctl: {}", name_, system_text(errno)));
  }
  handshake.socket = std::move(socket);
  arrivals_.emplace_back(
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(limits_.handshake_s)),
      id);
  pending_.emplace(id, std::move(handshake));
}

bool Gate::read_answer(uint64_t id, Handshake& handshake, std::vector<Admitted>& admitted) {
  // Exactly the answer: whatever the peer sends after it belongs to the owner.
  const ssize_t count = ::recv(handshake.socket.fd(), handshake.answer + handshake.received,
                               sizeof handshake.answer - handshake.received, MSG_DONTWAIT);
  if (count > 0) handshake.received += static_cast<size_t>(count);
  if (count == 0 || (count < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
    drop(id, "it closed the connection before proving the job secret");
    return true;
  }
  if (handshake.received < sizeof handshake.answer) return false;

  Hello hello;
  try {
    hello = check_auth_answer(secret_, handshake.nonce, handshake.answer, handshake.peer);
  } catch (const Error& error) {
    drop(id, error.what(), /*says_who=*/true);
    return true;
  }
  if (std::string unwanted = check_(hello); !unwanted.empty()) {
    drop(id, fmt::format("it proved the job secret but {}", unwanted));
    return true;
  }
  const AuthProof proof = acceptor_proof(secret_, handshake.nonce, handshake.answer);
  if (::send(handshake.socket.fd(), proof.data(), proof.size(), MSG_DONTWAIT | MSG_NOSIGNAL) !=
      static_cast<ssize_t>(proof.size())) {
    drop(id, "it could not take this side's proof of the secret");
    return true;
  }
  ::epoll_ctl(epoll_.fd(), EPOLL_CTL_DEL, handshake.socket.fd(), nullptr);
  ++stats_.admitted;
  admitted.push_back(Admitted{hello, std::move(handshake.socket), std::move(handshake.peer)});
  pending_.erase(id);  // its entry in arrivals_ is skipped when it comes to the front
  return true;
}

void Gate::drop(uint64_t id, const std::string& why, bool says_who) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  if (says_who) {
    warn("{}: {}", name_, why);
  } else {
    warn("{}: dropped a connection from {}: {}", name_, it->second.peer, why);
  }
  ::epoll_ctl(epoll_.fd(), EPOLL_CTL_DEL, it->second.socket.fd(), nullptr);
  pending_.erase(it);
  ++stats_.dropped;
}

void Gate::expire() {
  const auto now = Clock::now();
  while (!arrivals_.empty() &&
         (arrivals_.front().first <= now || !pending_.count(arrivals_.front().second))) {
    const uint64_t id = arrivals_.front().second;
    arrivals_.pop_front();
    drop(id, fmt::format("it did not prove the job secret within {} s", limits_.handshake_s));
  }
}

template <typename... Args>
void Gate::warn(fmt::format_string<Args...> format, Args&&... args) {
  if (warnings_.allow(Clock::now())) log::warn(format, std::forward<Args>(args)...);
}

void Gate::report_held_back(bool final) {
  if (const uint64_t held = warnings_.take_held_back(Clock::now(), final)) {
    log::warn("{} at {}: {} more warnings about connections that were not admitted were held "
              "back (at most {} are logged every {} s)",
              name_, endpoint_.to_string(), held, kWarningBurst, kWarningPeriod.count());
  }
}

namespace {

// After the acceptor closed a connection unadmitted, the next attempt waits this long, doubling up
// to the cap: a flood that pushes this connection out passes, and a listener not up yet starts.
constexpr auto kFirstRetry = std::chrono::milliseconds(5);
constexpr auto kMaxRetry = std::chrono::milliseconds(200);

void pause_before_retry(std::chrono::milliseconds& pause, const Deadline& deadline) {
  std::this_thread::sleep_for(
      std::min(pause, std::chrono::milliseconds(deadline.remaining_ms())));
  pause = std::min(pause * 2, kMaxRetry);
}

// A live acceptor sends its challenge as soon as it takes a connection. A connection that stays
// silent may be all that is left of a listener that has closed since (its process died as the
// connection was made) and that nobody will ever answer, so at each of these waits without the
// challenge a fresh connection asks whether anybody listens there still.
constexpr auto kFirstRecheck = std::chrono::milliseconds(500);
constexpr auto kMaxRecheck = std::chrono::milliseconds(2000);

// Waits until `socket` is readable (the challenge, or its close). False when a fresh connection to
// `endpoint` was refused meanwhile (*why says so), or the deadline passed (*taken counts the fresh
// connections that were taken: a process listens there).
bool await_challenge(const Socket& socket, const Endpoint& endpoint, const Deadline& deadline,
                     std::string* why, int* taken) {
  auto wait = kFirstRecheck;
  for (;;) {
    pollfd entry{socket.fd(), POLLIN, 0};
    const int ready =
        ::poll(&entry, 1, std::min<int>(static_cast<int>(wait.count()), deadline.remaining_ms()));
    if (ready != 0 || deadline.expired()) return true;  // the read that follows says what came
    int error = 0;
    std::string refused;
    Socket fresh = connect_once(endpoint, deadline, &refused, &error);
    if (!fresh.valid() && (error == ECONNREFUSED || error == ECONNRESET || error == EHOSTUNREACH)) {
      *why = fmt::format("{} took a connection and never answered it, and a fresh connection "
                         "found nobody listening ({})",
                         endpoint.to_string(), refused);
      return false;
    }
    if (fresh.valid()) {
      const linger reset{1, 0};  // closed with a reset: an acceptor that did not take it yet
      ::setsockopt(fresh.fd(), SOL_SOCKET, SO_LINGER, &reset, sizeof reset);  // never sees it
      ++*taken;
    }
    wait = std::min(wait * 2, kMaxRecheck);
  }
}

}  // namespace

Socket connect_authenticated(const Endpoint& endpoint, const std::string& secret,
                             const Hello& hello, const Deadline& deadline) {
  auto pause = kFirstRetry;
  // Why the acceptor last closed the connection unadmitted: what the caller gets when the
  // deadline ends the tries, also when it runs out in the middle of a later attempt.
  std::optional<Error> closed;
  for (;;) {
    try {
      Socket socket = connect_to(endpoint, deadline);
      authenticate_as_client(socket, secret, hello, deadline);
      return socket;
    } catch (const Error& error) {
      // Closed before the acceptor proved the secret: pushed out by strangers, or refused (a
      // wrong secret): either way nothing was said, so trying again is safe.
      if (error.status() == Status::kPeerLost) {
        closed = error;
      } else if (error.status() == Status::kTimeout && closed) {
        throw *closed;
      } else {
        throw;
      }
    }
    pause_before_retry(pause, deadline);
    if (deadline.expired()) throw *closed;
  }
}

Reach reach_authenticated(const Endpoint& endpoint, const std::string& secret, const Hello& hello,
                          const Deadline& deadline, Socket* socket, std::string* why) {
  auto pause = kFirstRetry;
  for (;;) {
    int error = 0;
    Socket attempt = connect_once(endpoint, deadline, why, &error);
    if (!attempt.valid()) {
      if (error == ECONNREFUSED || error == ECONNRESET || error == EHOSTUNREACH) {
        return Reach::kGone;
      }
      if (deadline.expired()) return Reach::kSilent;
    } else {
      int taken = 0;
      if (!await_challenge(attempt, endpoint, deadline, why, &taken)) return Reach::kGone;
      try {
        authenticate_as_client(attempt, secret, hello, deadline);
        *socket = std::move(attempt);
        return Reach::kAdmitted;
      } catch (const Error& failure) {
        if (failure.status() == Status::kMismatch) throw;
        *why = failure.what();
        if (taken > 0) {
          *why += fmt::format("; {} fresh connection(s) were taken meanwhile: a process listens "
                              "there and does not answer",
                              taken);
        }
        if (failure.status() != Status::kPeerLost || deadline.expired()) return Reach::kSilent;
      }
    }
    pause_before_retry(pause, deadline);
  }
}

}  // namespace kolo::net
