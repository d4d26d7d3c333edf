// A TCP port on 127.0.0.1 that was free a moment ago, for a rendezvous store that rank 0 binds a
// little later (the tests' jobs; kolorun binds its store's port itself instead). Picked at random below the kernel's ephemeral range:
// inside it, any outgoing connection, and any listener bound to port 0 (another job's), may take
// the port before rank 0 binds it; at random, so that jobs started at the same moment do not pick
// the same one. Falls back to a port the kernel picks; -1 (errno set) when nothing can be bound.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <random>

namespace kolo::tools {

// Binds a socket to 127.0.0.1:port (0: the kernel picks) and returns the port it got, or -1.
inline int bind_local_port(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t length = sizeof address;
  auto* generic = reinterpret_cast<sockaddr*>(&address);
  bool bound = ::bind(fd, generic, length) == 0 && ::getsockname(fd, generic, &length) == 0;
  int error = errno;
  ::close(fd);
  errno = error;
  return bound ? ntohs(address.sin_port) : -1;
}

inline int pick_free_local_port() {
  constexpr int kLowest = 10000;
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  if (ephemeral_low > kLowest + 1000) {
    std::mt19937 random(std::random_device{}());
    std::uniform_int_distribution<int> pick(kLowest, ephemeral_low - 1);
    for (int attempt = 0; attempt < 100; ++attempt) {
      if (int port = bind_local_port(pick(random)); port > 0) return port;
    }
  }
  return bind_local_port(0);
}

}  // namespace kolo::tools
