// The one way a connection gets into kolo. Every socket kolo listens on (the rendezvous store,
// each transport's mesh, the lifeline) admits through a Gate, because anyone on the network can
// connect to any of them: port scanners, a stranger that opens hundreds of connections and says
// nothing, one that sends garbage, a process of another job.
//
// What a Gate promises:
//   - It never blocks. Its owner polls fd() beside its own descriptors (poll or epoll), at most
//     timeout_ms() at a time, and calls advance(), which does whatever is ready and returns the
//     connections admitted since the last call.
//   - Handshakes run concurrently (net/auth.hpp's challenge and response, one message at a time),
//     each bounded by GateLimits::handshake_s. The listener is accepted from continually, so its
//     kernel backlog never fills and a real peer's connect is never refused or left unanswered
//     because strangers got there first.
//   - At most GateLimits::pending handshakes are under way; a new connection pushes out the
//     oldest, which is the one that has been silent longest. A silent flood thus holds a fixed
//     number of descriptors, and a real peer, which answers the challenge within a round trip,
//     gets in. A peer pushed out all the same sees its connection closed before this side proved
//     the secret, and connect_authenticated() below tries again until its deadline.
//   - The hello is checked (the tag, then the owner's Check on who it says it is) before this side
//     sends its own proof: a connection the owner does not want learns nothing and is closed.
//   - Nothing beyond the answer is read: an admitted socket holds whatever its peer sent next.
//   - Warnings about connections that were dropped are throttled (a few per period, the rest
//     counted and reported together), so a flood cannot flood the log.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/deadline.hpp"
#include "core/log.hpp"
#include "net/auth.hpp"
#include "net/socket.hpp"

namespace kolo::net {

struct GateLimits {
  size_t pending = 64;       // handshakes under way at once
  double handshake_s = 5.0;  // how long one connection may take to prove the job secret
};

struct GateStats {
  size_t pending = 0;     // handshakes under way now
  uint64_t admitted = 0;  // connections that proved the secret and passed the owner's check
  uint64_t dropped = 0;   // connections closed before or at the handshake
};

class Gate {
 public:
  // Who the owner expects: returns "" to admit a connection whose hello proved the secret, or why
  // it is not wanted (logged with the peer's address, throttled).
  using Check = std::function<std::string(const Hello&)>;

  struct Admitted {
    Hello hello;
    Socket socket;     // non-blocking, close-on-exec, TCP_NODELAY
    std::string peer;  // "host:port"
  };

  // Takes a listening socket (made non-blocking here). `name` prefixes log lines
  // ("rendezvous store", "tcp", "lifeline").
  Gate(Socket listener, std::string secret, std::string name, Check check, GateLimits limits = {});
  ~Gate();
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  // Readable whenever advance() has something to do.
  int fd() const { return epoll_.fd(); }
  // Milliseconds until advance() must run even if fd() stays quiet (a handshake's deadline, a
  // pause in accepting, throttled warnings to report); -1 for none.
  int timeout_ms() const;
  // Does what is ready without blocking; returns the connections admitted since the last call.
  std::vector<Admitted> advance();

  const Endpoint& endpoint() const { return endpoint_; }
  GateStats stats() const { return stats_; }

 private:
  struct Handshake {
    Socket socket;
    std::string peer;
    AuthNonce nonce{};
    uint8_t answer[kAuthAnswerBytes] = {};
    size_t received = 0;
  };

  void accept_ready();
  void start(Socket socket);
  // Reads what the connection sent; true when it has left `pending_` (admitted or dropped).
  bool read_answer(uint64_t id, Handshake& handshake, std::vector<Admitted>& admitted);
  // Logs (throttled) and closes; `why` names the peer itself when says_who.
  void drop(uint64_t id, const std::string& why, bool says_who = false);
  void expire();
  template <typename... Args>
  void warn(fmt::format_string<Args...> format, Args&&... args);
  void report_held_back(bool final);

  Socket listener_;
  Socket epoll_;
  Endpoint endpoint_;
  std::string secret_;
  std::string name_;
  Check check_;
  GateLimits limits_;
  std::unordered_map<uint64_t, Handshake> pending_;
  std::deque<std::pair<Clock::time_point, uint64_t>> arrivals_;  // oldest first
  uint64_t next_id_ = 1;
  bool accept_paused_ = false;
  Clock::time_point accept_resume_{};
  log::Throttle warnings_;
  GateStats stats_;
};

// The connecting side of a Gate: connects to endpoint and authenticates with `hello`, trying again
// while the acceptor closes the connection before it proves the secret (pushed out by strangers,
// or not listening yet) until the deadline. Returns the authenticated blocking socket. Throws
// kolo::Error: kTimeout at the deadline (naming the last reason), kMismatch when the acceptor
// does not know the secret.
Socket connect_authenticated(const Endpoint& endpoint, const std::string& secret,
                             const Hello& hello, const Deadline& deadline);

// What one attempt to reach a listener found, for deciding whether the process behind it lives.
enum class Reach {
  kAdmitted,  // it proved the secret and admitted this connection: it lives
  kGone,      // its host refused the connection, reset it or said it is unreachable, or took
              // it and never answered while a fresh connection was refused: nobody listens there
              // any more
  kSilent,    // no answer by the deadline, or the connection kept being closed unadmitted: no
              // evidence either way
};
// Like connect_authenticated, but one attempt's outcome is an answer rather than an error:
// *socket is the authenticated blocking socket when kAdmitted, and *why says what happened
// otherwise. Throws kolo::Error(kMismatch) when the acceptor does not know the secret.
Reach reach_authenticated(const Endpoint& endpoint, const std::string& secret, const Hello& hello,
                          const Deadline& deadline, Socket* socket, std::string* why);

}  // namespace kolo::net
