// Blocking TCP helpers with deadlines. Every wait goes through poll() with what is left of the
// caller's deadline, and the I/O itself uses MSG_DONTWAIT, so no call here can outlive its deadline
// even on a socket that was left in blocking mode.
#include "net/socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "kolo/status.hpp"

namespace kolo::net {
namespace {

std::string errno_text(int error) {
  return std::generic_category().message(error);
}

[[noreturn]] void throw_system(const std::string& what, int error) {
  throw Error(Status::kSystem, fmt::format("{}: {}", what, errno_text(error)));
}

// poll() timeout for what is left of a deadline; never 0 while time remains, so a deadline with
// less than a millisecond left does not turn into a busy loop.
int poll_timeout_ms(const Deadline& deadline) {
  int ms = deadline.remaining_ms();
  if (ms == 0 && !deadline.expired()) ms = 1;
  return ms;
}

// Waits until fd is ready for `events`. Returns false when the deadline passed first.
// describe() names the operation, and is only called if poll itself fails.
template <typename Describe>
bool wait_ready(int fd, short events, const Deadline& deadline, Describe describe) {
  for (;;) {
    pollfd entry{fd, events, 0};
    int ready = ::poll(&entry, 1, poll_timeout_ms(deadline));
    if (ready > 0) return true;  // readable, writable, or an error the next call will report
    if (ready < 0 && errno != EINTR) throw_system(describe() + ": poll", errno);
    if (deadline.expired()) return false;
  }
}

Endpoint endpoint_from_sockaddr(const sockaddr* address, socklen_t length) {
  if (address->sa_family != AF_INET && address->sa_family != AF_INET6) {
    throw Error(Status::kSystem, fmt::format("the socket is not an IP socket (address family {})",
                                             static_cast<int>(address->sa_family)));
  }
  char host[NI_MAXHOST];
  char port[NI_MAXSERV];
  int rc = ::getnameinfo(address, length, host, sizeof host, port, sizeof port,
                         NI_NUMERICHOST | NI_NUMERICSERV);
  if (rc != 0) {
    throw Error(Status::kSystem, fmt::format("getnameinfo: {}", ::gai_strerror(rc)));
  }
  Endpoint endpoint;
  endpoint.host = host;
  endpoint.port = static_cast<uint16_t>(std::strtoul(port, nullptr, 10));
  return endpoint;
}

// The other end of a socket, captured before an operation so that an error can still name it
// after a reset (getpeername fails once the connection is gone). Formatting waits for an error.
class PeerAddress {
 public:
  explicit PeerAddress(int fd) : fd_(fd) {
    valid_ = ::getpeername(fd, reinterpret_cast<sockaddr*>(&address_), &length_) == 0;
  }
  // Never throws: it is called while reporting another error.
  std::string to_string() const {
    if (!valid_) return fmt::format("a disconnected peer (fd {})", fd_);
    if (address_.ss_family == AF_UNIX) return "a local socket peer";
    try {
      return endpoint_from_sockaddr(reinterpret_cast<const sockaddr*>(&address_), length_)
          .to_string();
    } catch (const Error&) {
      return fmt::format("a peer of unknown address (fd {})", fd_);
    }
  }

 private:
  int fd_;
  bool valid_ = false;
  sockaddr_storage address_{};
  socklen_t length_ = sizeof address_;
};

std::string describe_peer(int fd) {
  return PeerAddress(fd).to_string();
}

struct AddrinfoDeleter {
  void operator()(addrinfo* list) const { ::freeaddrinfo(list); }
};
using AddrinfoList = std::unique_ptr<addrinfo, AddrinfoDeleter>;

AddrinfoList resolve(const Endpoint& endpoint, bool passive, const std::string& purpose) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  // An empty host means every IPv4 address; binding to "::" would depend on bindv6only.
  std::string host = endpoint.host.empty() ? "0.0.0.0" : endpoint.host;
  std::string port = std::to_string(endpoint.port);
  addrinfo* list = nullptr;
  int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &list);
  if (rc != 0) {
    std::string reason = rc == EAI_SYSTEM ? errno_text(errno) : ::gai_strerror(rc);
    throw Error(Status::kSystem, fmt::format("cannot resolve '{}' to {} {}: {}", endpoint.host,
                                             purpose, endpoint.to_string(), reason));
  }
  return AddrinfoList(list);
}

bool connect_error_is_transient(int error) {
  // The listener may not be up yet, or the route may still be coming up. A listener that closed
  // while this connection waited in its backlog resets it: no listener, as when refused (a
  // lifeline probe of a rank killed that moment saw this, kolo_comm_shrink).
  return error == ECONNREFUSED || error == ECONNRESET || error == ENETUNREACH ||
         error == ETIMEDOUT || error == EHOSTUNREACH || error == EAGAIN;
}

// One connection attempt to one address, bounded by the deadline. Returns the connected
// (non-blocking) socket, or an invalid one with *error set when the attempt failed.
Socket try_connect(const addrinfo& address, const Deadline& deadline, const std::string& target,
                   int* error) {
  Socket socket(::socket(address.ai_family, address.ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                         address.ai_protocol));
  if (!socket.valid()) throw_system(fmt::format("socket() for connecting to {}", target), errno);
  if (::connect(socket.fd(), address.ai_addr, address.ai_addrlen) == 0) return socket;
  if (errno != EINPROGRESS && errno != EINTR) {
    *error = errno;
    return Socket();
  }
  if (!wait_ready(socket.fd(), POLLOUT, deadline, [&] { return "connect to " + target; })) {
    *error = ETIMEDOUT;
    return Socket();
  }
  int pending = 0;
  socklen_t length = sizeof pending;
  if (::getsockopt(socket.fd(), SOL_SOCKET, SO_ERROR, &pending, &length) != 0) pending = errno;
  if (pending != 0) {
    *error = pending;
    return Socket();
  }
  return socket;
}

// One attempt at each address in turn, until one connects: the blocking socket (TCP_NODELAY), or
// an invalid one with *error set when every attempt failed for a reason worth retrying; throws
// for any other reason.
Socket try_every_address(const AddrinfoList& list, const Deadline& deadline,
                         const std::string& target, int* error) {
  for (addrinfo* address = list.get(); address != nullptr; address = address->ai_next) {
    Socket socket = try_connect(*address, deadline, target, error);
    if (socket.valid()) {
      set_nonblocking(socket, false);
      set_nodelay(socket);
      return socket;
    }
    if (!connect_error_is_transient(*error)) {
      throw_system(fmt::format("cannot connect to {}", target), *error);
    }
    if (deadline.expired()) break;
  }
  return Socket();
}

void set_int_option(const Socket& socket, int level, int name, int value, const char* what) {
  if (::setsockopt(socket.fd(), level, name, &value, sizeof value) != 0) {
    throw_system(
        fmt::format("setsockopt({}) on the connection to {}", what, describe_peer(socket.fd())),
        errno);
  }
}

}  // namespace

std::string Endpoint::to_string() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host.empty() ? "0.0.0.0" : host, port);
}

Endpoint parse_endpoint(const std::string& text, const std::string& what) {
  auto fail = [&](std::string_view reason) -> Error {
    return Error(Status::kConfig,
                 fmt::format("{}='{}' is not an address: {} (expected host:port or [IPv6]:port)",
                             what, text, reason));
  };
  std::string host;
  std::string port;
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos) throw fail("'[' without a matching ']'");
    host = text.substr(1, close - 1);
    if (close + 1 >= text.size() || text[close + 1] != ':') throw fail("missing port");
    port = text.substr(close + 2);
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string::npos) throw fail("missing port");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != std::string::npos) {
      throw fail("an IPv6 address must be written in brackets, as [addr]:port");
    }
  }
  if (host.empty()) throw fail("missing host");
  // No address or host name has brackets, and a host with one would not print as text that
  // parses back (Endpoint::to_string).
  if (host.find_first_of("[]") != std::string::npos) throw fail("a host cannot contain '[' or ']'");
  if (port.empty()) throw fail("missing port");
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos) {
    throw fail(fmt::format("port '{}' is not a number from 0 to 65535", port));
  }
  unsigned long number = std::stoul(port);
  if (number > 65535) throw fail(fmt::format("port {} is out of range (0 to 65535)", number));
  return Endpoint{host, static_cast<uint16_t>(number)};
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.release();
  }
  return *this;
}

Socket::~Socket() {
  close();
}

int Socket::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::close() {
  // Not retried on EINTR: on Linux the descriptor is released even then.
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Socket listen_on(const Endpoint& endpoint, int backlog) {
  AddrinfoList list = resolve(endpoint, /*passive=*/true, "listen on");
  int last_error = 0;
  std::string last_step;
  for (addrinfo* address = list.get(); address != nullptr; address = address->ai_next) {
    Socket socket(
        ::socket(address->ai_family, address->ai_socktype | SOCK_CLOEXEC, address->ai_protocol));
    if (!socket.valid()) {
      last_error = errno;
      last_step = "socket";
      continue;
    }
    int one = 1;
    ::setsockopt(socket.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(socket.fd(), address->ai_addr, address->ai_addrlen) != 0) {
      last_error = errno;
      last_step = "bind";
      continue;
    }
    if (::listen(socket.fd(), backlog) != 0) {
      last_error = errno;
      last_step = "listen";
      continue;
    }
    return socket;
  }
  throw_system(fmt::format("cannot listen on {} ({})", endpoint.to_string(), last_step),
               last_error);
}

Endpoint local_endpoint(const Socket& socket) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  if (::getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw_system("getsockname", errno);
  }
  return endpoint_from_sockaddr(reinterpret_cast<sockaddr*>(&address), length);
}

Endpoint peer_endpoint(const Socket& socket) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  if (::getpeername(socket.fd(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw_system("getpeername", errno);
  }
  return endpoint_from_sockaddr(reinterpret_cast<sockaddr*>(&address), length);
}

Socket connect_to(const Endpoint& endpoint, const Deadline& deadline) {
  const auto start = Clock::now();
  const std::string target = endpoint.to_string();
  AddrinfoList list = resolve(endpoint, /*passive=*/false, "connect to");
  auto retry_delay = std::chrono::milliseconds(10);
  int last_error = 0;
  for (;;) {
    Socket socket = try_every_address(list, deadline, target, &last_error);
    if (socket.valid()) return socket;
    if (deadline.expired()) break;
    auto pause = std::min<std::chrono::milliseconds>(
        retry_delay, std::chrono::milliseconds(poll_timeout_ms(deadline)));
    std::this_thread::sleep_for(pause);
    retry_delay = std::min(retry_delay * 2, std::chrono::milliseconds(50));
  }
  double waited = std::chrono::duration<double>(Clock::now() - start).count();
  throw Error(Status::kTimeout,
              fmt::format("could not connect to {} within {:.3g} s (last attempt: {}); is the "
                          "listener running at that address?",
                          target, waited, errno_text(last_error)));
}

Socket connect_once(const Endpoint& endpoint, const Deadline& deadline, std::string* why,
                    int* error) {
  const std::string target = endpoint.to_string();
  AddrinfoList list = resolve(endpoint, /*passive=*/false, "connect to");
  int last_error = 0;
  Socket socket = try_every_address(list, deadline, target, &last_error);
  if (!socket.valid() && why) *why = fmt::format("{}: {}", target, errno_text(last_error));
  if (error) *error = socket.valid() ? 0 : last_error;
  return socket;
}

Socket accept_from(const Socket& listener, const Deadline& deadline) {
  for (;;) {
    if (!wait_ready(listener.fd(), POLLIN, deadline, [] { return std::string("accept"); })) {
      std::string where;
      try {
        where = local_endpoint(listener).to_string();
      } catch (const Error&) {
        where = fmt::format("fd {}", listener.fd());
      }
      throw Error(Status::kTimeout, fmt::format("timed out waiting for a connection on {}", where));
    }
    // SOCK_NONBLOCK only so that a connection that vanished between poll and accept cannot
    // block us; the returned socket is made blocking as promised.
    Socket socket(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (socket.valid()) {
      set_nonblocking(socket, false);
      return socket;
    }
    int error = errno;
    if (error == EINTR || error == EAGAIN || error == EWOULDBLOCK || error == ECONNABORTED ||
        error == EPROTO) {
      continue;
    }
    throw_system("accept", error);
  }
}

void send_all(const Socket& socket, const void* data, size_t bytes, const Deadline& deadline) {
  const auto* cursor = static_cast<const uint8_t*>(data);
  const PeerAddress peer(socket.fd());
  size_t sent = 0;
  while (sent < bytes) {
    ssize_t n = ::send(socket.fd(), cursor + sent, bytes - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    int error = errno;
    if (error == EINTR) continue;
    if (error == EAGAIN || error == EWOULDBLOCK) {
      if (!wait_ready(socket.fd(), POLLOUT, deadline,
                      [&] { return "send to " + peer.to_string(); })) {
        throw Error(Status::kTimeout, fmt::format("timed out sending {} bytes to {} ({} sent)",
                                                  bytes, peer.to_string(), sent));
      }
      continue;
    }
    if (error == EPIPE || error == ECONNRESET) {
      throw Error(Status::kPeerLost,
                  fmt::format("connection closed (reset) by {} while sending ({} of {} bytes sent)",
                              peer.to_string(), sent, bytes));
    }
    throw_system(fmt::format("send to {}", peer.to_string()), error);
  }
}

void recv_all(const Socket& socket, void* data, size_t bytes, const Deadline& deadline) {
  auto* cursor = static_cast<uint8_t*>(data);
  const PeerAddress peer(socket.fd());
  size_t received = 0;
  while (received < bytes) {
    ssize_t n = ::recv(socket.fd(), cursor + received, bytes - received, MSG_DONTWAIT);
    if (n > 0) {
      received += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      throw Error(Status::kPeerLost,
                  fmt::format("connection closed by {} while receiving ({} of {} bytes received)",
                              peer.to_string(), received, bytes));
    }
    int error = errno;
    if (error == EINTR) continue;
    if (error == EAGAIN || error == EWOULDBLOCK) {
      if (!wait_ready(socket.fd(), POLLIN, deadline,
                      [&] { return "receive from " + peer.to_string(); })) {
        throw Error(Status::kTimeout,
                    fmt::format("timed out receiving {} bytes from {} ({} received)", bytes,
                                peer.to_string(), received));
      }
      continue;
    }
    if (error == ECONNRESET || error == EPIPE) {
      throw Error(
          Status::kPeerLost,
          fmt::format("connection closed (reset) by {} while receiving ({} of {} bytes received)",
                      peer.to_string(), received, bytes));
    }
    throw_system(fmt::format("receive from {}", peer.to_string()), error);
  }
}

void set_nonblocking(const Socket& socket, bool nonblocking) {
  int flags = ::fcntl(socket.fd(), F_GETFL);
  if (flags < 0) throw_system("fcntl(F_GETFL)", errno);
  int wanted = nonblocking ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  if (wanted != flags && ::fcntl(socket.fd(), F_SETFL, wanted) != 0) {
    throw_system("fcntl(F_SETFL, O_NONBLOCK)", errno);
  }
}

void set_nodelay(const Socket& socket) {
  set_int_option(socket, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY");
}

void enable_keepalive(const Socket& socket) {
  // Silent for 5 s, then 5 probes 1 s apart; and data unacknowledged for 10 s fails the
  // connection.
  set_int_option(socket, SOL_SOCKET, SO_KEEPALIVE, 1, "SO_KEEPALIVE");
  set_int_option(socket, IPPROTO_TCP, TCP_KEEPIDLE, 5, "TCP_KEEPIDLE");
  set_int_option(socket, IPPROTO_TCP, TCP_KEEPINTVL, 1, "TCP_KEEPINTVL");
  set_int_option(socket, IPPROTO_TCP, TCP_KEEPCNT, 5, "TCP_KEEPCNT");
  set_int_option(socket, IPPROTO_TCP, TCP_USER_TIMEOUT, 10000, "TCP_USER_TIMEOUT");
}

void tune_for_bulk(const Socket& socket, int buffer_bytes) {
  if (buffer_bytes > 0) {
    // Best effort: the kernel caps these at net.core.{w,r}mem_max, and a smaller buffer is only
    // slower, not wrong.
    ::setsockopt(socket.fd(), SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof buffer_bytes);
    ::setsockopt(socket.fd(), SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof buffer_bytes);
  }
  enable_keepalive(socket);
}

void limit_unsent(const Socket& socket, int bytes) {
  set_int_option(socket, IPPROTO_TCP, TCP_NOTSENT_LOWAT, bytes, "TCP_NOTSENT_LOWAT");
}

namespace {

std::string congestion_control(const Socket& socket) {
  char name[16] = {};  // Linux's TCP_CA_NAME_MAX
  socklen_t length = sizeof name;
  if (::getsockopt(socket.fd(), IPPROTO_TCP, TCP_CONGESTION, name, &length) != 0) {
    throw_system(fmt::format("getsockopt(TCP_CONGESTION) on the connection to {}",
                             describe_peer(socket.fd())),
                 errno);
  }
  return std::string(name, strnlen(name, std::min<size_t>(length, sizeof name)));
}

std::string allowed_congestion_controls() {
  std::ifstream file("/proc/sys/net/ipv4/tcp_allowed_congestion_control");
  std::string allowed;
  std::getline(file, allowed);
  return allowed.empty() ? "unknown" : allowed;
}

}  // namespace

bool connects_this_host(const Socket& socket) {
  const std::string peer = peer_endpoint(socket).host;
  return peer == local_endpoint(socket).host || is_loopback_address(peer);
}

std::string set_congestion_control(const Socket& socket, const std::string& policy) {
  if (policy == "system" || (policy == "auto" && !connects_this_host(socket))) {
    return congestion_control(socket);
  }
  const std::string name = policy == "auto" ? "reno" : policy;
  if (::setsockopt(socket.fd(), IPPROTO_TCP, TCP_CONGESTION, name.data(), name.size()) != 0) {
    const int error = errno;
    if (policy == "auto") return congestion_control(socket);  // reno is built in; keep going
    throw Error(Status::kConfig,
                fmt::format("kolo: KOLO_TCP_CONGESTION={}: this kernel does not let kolo use it "
                            "on the connection to {} ({}); it allows: {}",
                            name, describe_peer(socket.fd()), errno_text(error),
                            allowed_congestion_controls()));
  }
  return congestion_control(socket);
}

namespace {

// One interface's addresses, IPv4 first, without link-local IPv6.
struct Interface {
  std::string name;
  bool up = false;
  bool loopback = false;
  std::vector<std::string> ipv4, ipv6;
  const std::string* address() const {
    if (!ipv4.empty()) return &ipv4.front();
    if (!ipv6.empty()) return &ipv6.front();
    return nullptr;
  }
};

std::vector<Interface> list_interfaces() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) throw_system("getifaddrs", errno);
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> owner(list, ::freeifaddrs);
  std::vector<Interface> interfaces;
  for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    std::string name = entry->ifa_name != nullptr ? entry->ifa_name : "";
    auto it = std::find_if(interfaces.begin(), interfaces.end(),
                           [&](const Interface& item) { return item.name == name; });
    if (it == interfaces.end()) {
      it = interfaces.insert(interfaces.end(), Interface{});
      it->name = name;
    }
    it->up = it->up || (entry->ifa_flags & IFF_UP) != 0;
    it->loopback = it->loopback || (entry->ifa_flags & IFF_LOOPBACK) != 0;
    if (entry->ifa_addr == nullptr) continue;
    char text[INET6_ADDRSTRLEN] = {};
    if (entry->ifa_addr->sa_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(entry->ifa_addr);
      if (::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text)) it->ipv4.push_back(text);
    } else if (entry->ifa_addr->sa_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(entry->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&v6->sin6_addr)) continue;
      if (::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text)) it->ipv6.push_back(text);
    }
  }
  return interfaces;
}

std::vector<std::string> split_commas(std::string_view text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = std::min(text.find(',', start), text.size());
    if (comma > start) parts.emplace_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return parts;
}

}  // namespace

std::string interface_address(const std::string& spec) {
  std::string_view rest = spec;
  bool exclude = !rest.empty() && rest.front() == '^';
  if (exclude) rest.remove_prefix(1);
  bool exact = !rest.empty() && rest.front() == '=';
  if (exact) rest.remove_prefix(1);
  std::vector<std::string> names = split_commas(rest);
  if (names.empty()) {
    throw Error(Status::kConfig,
                fmt::format("KOLO_SOCKET_IFNAME='{}' names no interface (expected e.g. eth0, "
                            "=eth0, eth,ib or ^docker,lo)", spec));
  }
  auto listed = [&](const std::string& name) {
    return std::any_of(names.begin(), names.end(), [&](const std::string& wanted) {
      return exact ? name == wanted : name.compare(0, wanted.size(), wanted) == 0;
    });
  };
  std::vector<Interface> interfaces = list_interfaces();
  // With "^", loopback is the last resort, as an interface that is down is never chosen.
  for (bool allow_loopback : {false, true}) {
    for (const Interface& candidate : interfaces) {
      if (listed(candidate.name) == exclude || candidate.address() == nullptr) continue;
      if (exclude && (!candidate.up || (candidate.loopback && !allow_loopback))) continue;
      return *candidate.address();
    }
    if (!exclude) break;
  }
  std::string listing;
  for (const Interface& candidate : interfaces) {
    std::vector<std::string> addresses = candidate.ipv4;
    addresses.insert(addresses.end(), candidate.ipv6.begin(), candidate.ipv6.end());
    listing += listing.empty() ? "" : ", ";
    listing += addresses.empty() ? candidate.name
                                 : fmt::format("{} ({})", candidate.name, fmt::join(addresses, " "));
  }
  throw Error(Status::kConfig,
              fmt::format("KOLO_SOCKET_IFNAME={}: no interface with an address matches; "
                          "interfaces here: {}",
                          spec, listing.empty() ? "none" : listing));
}

std::string route_source_address(const Endpoint& remote, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  std::string port = std::to_string(remote.port == 0 ? 9 : remote.port);
  int rc = ::getaddrinfo(remote.host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) {
    std::string reason = rc == EAI_SYSTEM ? errno_text(errno) : ::gai_strerror(rc);
    throw Error(Status::kConfig,
                fmt::format("{}: the host name '{}' does not resolve on host {} ({}); set {} to an "
                            "address this host can resolve, or KOLO_SOCKET_IFNAME to the "
                            "interface to use",
                            what, remote.host, host_name(), reason, what));
  }
  AddrinfoList list(found);
  int last_error = 0;
  for (addrinfo* address = list.get(); address != nullptr; address = address->ai_next) {
    Socket probe(::socket(address->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!probe.valid() || ::connect(probe.fd(), address->ai_addr, address->ai_addrlen) != 0) {
      last_error = errno;
      continue;
    }
    return local_endpoint(probe).host;
  }
  throw Error(Status::kConfig,
              fmt::format("{}: host {} has no route to '{}' ({}); set KOLO_SOCKET_IFNAME to the "
                          "interface that reaches it",
                          what, host_name(), remote.host, errno_text(last_error)));
}

bool is_numeric_address(const std::string& host) {
  in6_addr scratch{};
  return ::inet_pton(AF_INET, host.c_str(), &scratch) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &scratch) == 1;
}

bool is_loopback_address(const std::string& numeric_host) {
  in_addr v4{};
  if (::inet_pton(AF_INET, numeric_host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6{};
  if (::inet_pton(AF_INET6, numeric_host.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

std::string host_name() {
  char name[HOST_NAME_MAX + 1] = {};
  if (::gethostname(name, sizeof name - 1) != 0) throw_system("gethostname", errno);
  return name;
}

Socket adopt_listener(int fd, const std::string& what) {
  int listening = 0;
  socklen_t length = sizeof listening;
  std::string why;
  if (fd < 0) {
    why = "not a descriptor";
  } else if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) != 0) {
    why = std::generic_category().message(errno);  // not open, or not a socket
  } else if (listening != 1) {
    why = "the socket does not listen";
  }
  if (!why.empty()) {
    throw Error(Status::kConfig,
                fmt::format("{}={}: not a listening socket of this process ({})", what, fd, why));
  }
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return Socket(fd);
}

}  // namespace kolo::net
