// Blocking TCP helpers with deadlines, for start-up paths: the rendezvous store and the transport's
// connection set-up. Data paths use their own non-blocking loops (src/transport/tcp/).
// Every failure throws kolo::Error: kTimeout when the deadline passes, kPeerLost when the other end
// closes or resets, kSystem for other OS errors; messages name the address and the operation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/deadline.hpp"

namespace kolo::net {

struct Endpoint {
  std::string host;  // numeric IPv4/IPv6 address or a name; "" means any address when listening
  uint16_t port = 0;
  std::string to_string() const;  // "host:port", IPv6 as "[addr]:port"
};

// Parses "host:port" or "[v6addr]:port". Throws kolo::Error(kConfig) naming `what` (e.g. "KOLO_ADDR")
// and the text when malformed.
Endpoint parse_endpoint(const std::string& text, const std::string& what);

// An owned file descriptor. Move-only; closes on destruction.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket();

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void close();

 private:
  int fd_ = -1;
};

// A listening socket bound to endpoint (port 0: the kernel picks), SO_REUSEADDR, close-on-exec.
Socket listen_on(const Endpoint& endpoint, int backlog = 128);
// Takes ownership of fd, a listening TCP socket this process inherited (from its launcher), and
// makes it close-on-exec. Throws kolo::Error(kConfig) naming `what` (e.g. "KOLO_STORE_FD") and
// the descriptor when it is not open or not a listening socket.
Socket adopt_listener(int fd, const std::string& what);
// The address a socket is bound to (numeric host).
Endpoint local_endpoint(const Socket& socket);
// The address of the other end of a connected socket (numeric host).
Endpoint peer_endpoint(const Socket& socket);

// Connects, retrying refused and unreachable attempts every few milliseconds until the deadline
// (the listener may not be up yet). Sets TCP_NODELAY. Returns a blocking socket.
Socket connect_to(const Endpoint& endpoint, const Deadline& deadline);
// One attempt per address of endpoint, bounded by the deadline, without retrying: returns the
// connected blocking socket (TCP_NODELAY), or an invalid one when nobody listens there (refused,
// unreachable, or no answer by the deadline), with the reason in *why and its errno in *error
// (ETIMEDOUT when the deadline passed). For asking whether a process that once listened there is
// still alive.
Socket connect_once(const Endpoint& endpoint, const Deadline& deadline, std::string* why,
                    int* error = nullptr);
// Waits for one connection on a listening socket; throws kTimeout at the deadline.
Socket accept_from(const Socket& listener, const Deadline& deadline);

// Reads or writes exactly `bytes`, waiting with poll() no longer than the deadline.
void send_all(const Socket& socket, const void* data, size_t bytes, const Deadline& deadline);
void recv_all(const Socket& socket, void* data, size_t bytes, const Deadline& deadline);

// Socket options used for data connections.
void set_nonblocking(const Socket& socket, bool nonblocking);
void set_nodelay(const Socket& socket);
// TCP keepalive probing a silent peer within ~10 s, and TCP_USER_TIMEOUT so unacknowledged data
// to a vanished host fails within ~10 s: a peer whose host vanished (power loss, a cable) sends
// no FIN or RST, and without these a connection to it would wait for the kernel's two-hour
// defaults. For every long-lived connection (data, control, the rendezvous store's).
void enable_keepalive(const Socket& socket);
// SO_SNDBUF/SO_RCVBUF (best effort), and enable_keepalive.
void tune_for_bulk(const Socket& socket, int buffer_bytes);
// TCP_NOTSENT_LOWAT: the socket takes new data only while less than `bytes` of what it holds is
// still unsent, and reports itself writable only then. The rest of the send buffer holds data in
// flight. Throws kolo::Error(kSystem) when the kernel refuses.
void limit_unsent(const Socket& socket, int bytes);

// TCP congestion control for a data connection, by KOLO_TCP_CONGESTION's policy: "system" leaves
// the kernel's default; "auto" sets reno where both ends are on this machine (the two addresses
// are equal, or loopback), where there is no network to share and a pacing algorithm such as bbr
// only holds the sender back, and leaves the default elsewhere; any other value is the name of an
// algorithm to set on every connection. Returns the algorithm the connection uses afterwards.
// Throws kolo::Error(kConfig) naming the algorithm and the ones this kernel lets us choose when it
// refuses a named one.
std::string set_congestion_control(const Socket& socket, const std::string& policy);
// True when both ends of a connected socket are on this machine.
bool connects_this_host(const Socket& socket);

// The address of the first interface, in the kernel's order, that `spec` selects, with NCCL's
// grammar for KOLO_SOCKET_IFNAME: a comma-separated list of name prefixes ("eth,ib"), "=" before
// the list for exact names ("=eth0"), "^" before it to take every interface except those
// ("^docker,lo"; loopback is then skipped too unless nothing else is up). An interface's first
// IPv4 address wins over its IPv6 ones (link-local IPv6 addresses are never used). Throws
// kolo::Error(kConfig) naming KOLO_SOCKET_IFNAME, the spec and the interfaces that exist.
std::string interface_address(const std::string& spec);

// The numeric local address this machine sends from to reach `remote` (a host name, or an IPv4 or
// IPv6 literal): the name is resolved and the kernel's routing table asked, with a UDP socket that
// sends nothing. Throws kolo::Error(kConfig) naming the host and `what` (e.g. "KOLO_ADDR") when the
// name does not resolve or no route leads there.
std::string route_source_address(const Endpoint& remote, const std::string& what);

// True for a numeric IPv4 or IPv6 address (as opposed to a host name).
bool is_numeric_address(const std::string& host);
// True for 127.0.0.0/8, ::1 and IPv4-mapped loopback.
bool is_loopback_address(const std::string& numeric_host);

// This machine's host name (for log prefixes and local-rank grouping).
std::string host_name();

}  // namespace kolo::net
