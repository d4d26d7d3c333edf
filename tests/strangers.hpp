// Strangers on every port: while a job runs, a thread of the test finds every TCP port its ranks
// listen on (from /proc, not from kolo: the rendezvous store, each transport's mesh while it
// connects, the fusion engine's mesh, the lifeline, and anything else) and opens connections to
// each, as a stranger on the same network could: `idle` that say nothing and `garbage` that send
// 64 random bytes. It opens a fresh wave every `wave_s` seconds, closing the one before, so that
// the ports are crowded for as long as the job runs (a listener may drop silent connections after
// a few seconds), not only when each port first appears.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace kolo::test {

struct ListeningPort {
  std::string address;  // numeric IPv4 or IPv6
  bool ipv6 = false;
  uint16_t port = 0;
  bool operator<(const ListeningPort& other) const {
    return std::tie(address, port) < std::tie(other.address, other.port);
  }
};

// The socket inodes a process holds open.
inline std::set<uint64_t> socket_inodes(pid_t pid) {
  std::set<uint64_t> inodes;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* listing = ::opendir(dir.c_str());
  if (listing == nullptr) return inodes;
  while (dirent* entry = ::readdir(listing)) {
    char target[128];
    const std::string path = dir + "/" + entry->d_name;
    const ssize_t length = ::readlink(path.c_str(), target, sizeof target - 1);
    if (length <= 0) continue;
    target[length] = '\0';
    unsigned long long inode = 0;
    if (std::sscanf(target, "socket:[%llu]", &inode) == 1) inodes.insert(inode);
  }
  ::closedir(listing);
  return inodes;
}

// A process whose listeners to crowd. A listener on every address is reached at
// `wildcard_address`; with `remote` (the crowd runs in another network namespace) listeners on a
// loopback address are out of reach and left alone.
struct Target {
  pid_t pid = 0;
  std::string wildcard_address = "127.0.0.1";
  bool remote = false;
};

// Every TCP port in state LISTEN held by one of `targets`, read from the table of each target's
// own network namespace (/proc/PID/net/tcp and tcp6).
inline std::set<ListeningPort> listening_ports(const std::vector<Target>& targets) {
  std::set<ListeningPort> ports;
  for (const Target& target : targets) {
    const std::set<uint64_t> inodes = socket_inodes(target.pid);
    for (const bool ipv6 : {false, true}) {
      std::ifstream table("/proc/" + std::to_string(target.pid) + (ipv6 ? "/net/tcp6" : "/net/tcp"));
      std::string line;
      std::getline(table, line);  // the header
      while (std::getline(table, line)) {
        std::istringstream fields(line);
        std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout;
        uint64_t inode = 0;
        fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
            timeout >> inode;
        if (state != "0A" || !inodes.count(inode)) continue;
        const size_t colon = local.find(':');
        ListeningPort port;
        port.ipv6 = ipv6;
        port.port = static_cast<uint16_t>(std::stoul(local.substr(colon + 1), nullptr, 16));
        const std::string hex = local.substr(0, colon);
        char text[INET6_ADDRSTRLEN] = {};
        if (!ipv6) {
          in_addr address{};
          address.s_addr = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
          ::inet_ntop(AF_INET, &address, text, sizeof text);
        } else {
          in6_addr address{};
          for (int word = 0; word < 4; ++word) {
            const auto value =
                static_cast<uint32_t>(std::stoul(hex.substr(8 * word, 8), nullptr, 16));
            std::memcpy(address.s6_addr + 4 * word, &value, 4);
          }
          ::inet_ntop(AF_INET6, &address, text, sizeof text);
        }
        port.address = text;
        const bool loopback = port.address.rfind("127.", 0) == 0 || port.address == "::1";
        if (loopback && target.remote) continue;
        if (port.address == "0.0.0.0" || port.address == "::") {
          port.address = target.wildcard_address;
          port.ipv6 = port.address.find(':') != std::string::npos;
        }
        ports.insert(port);
      }
    }
  }
  return ports;
}

class Strangers {
 public:
  Strangers(std::vector<Target> targets, int idle = 200, int garbage = 20, double wave_s = 1.0)
      : targets_(std::move(targets)), idle_(idle), garbage_(garbage), wave_s_(wave_s) {
    thread_ = std::thread([this] { run(); });
  }
  ~Strangers() {
    stop_ = true;
    thread_.join();
    for (int fd : open_) ::close(fd);
  }
  Strangers(const Strangers&) = delete;
  Strangers& operator=(const Strangers&) = delete;

  // The ports flooded so far, and the connections opened in all.
  std::set<ListeningPort> ports() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }
  uint64_t connections() const { return connections_; }

 private:
  void run() {
    auto next_wave = std::chrono::steady_clock::now();
    std::set<ListeningPort> flooded_this_wave;
    std::vector<int> previous;
    while (!stop_) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_wave) {
        for (int fd : previous) ::close(fd);
        previous = std::move(open_);
        open_.clear();
        flooded_this_wave.clear();
        next_wave = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(wave_s_));
      }
      for (const ListeningPort& port : listening_ports(targets_)) {
        if (flooded_this_wave.count(port)) continue;
        flooded_this_wave.insert(port);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          seen_.insert(port);
        }
        open(port, idle_, false);
        open(port, garbage_, true);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    for (int fd : previous) ::close(fd);
  }

  // Opens `count` connections to port without waiting for any; the garbage ones send their bytes
  // once connected (one wait for all of them, at most 200 ms).
  void open(const ListeningPort& port, int count, bool garbage) {
    std::vector<pollfd> connecting;
    for (int i = 0; i < count && !stop_; ++i) {
      const int fd = ::socket(port.ipv6 ? AF_INET6 : AF_INET,
                              SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) return;
      sockaddr_storage address{};
      socklen_t length = 0;
      if (port.ipv6) {
        auto* v6 = reinterpret_cast<sockaddr_in6*>(&address);
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons(port.port);
        ::inet_pton(AF_INET6, port.address.c_str(), &v6->sin6_addr);
        length = sizeof *v6;
      } else {
        auto* v4 = reinterpret_cast<sockaddr_in*>(&address);
        v4->sin_family = AF_INET;
        v4->sin_port = htons(port.port);
        ::inet_pton(AF_INET, port.address.c_str(), &v4->sin_addr);
        length = sizeof *v4;
      }
      if (::connect(fd, reinterpret_cast<sockaddr*>(&address), length) != 0 &&
          errno != EINPROGRESS) {
        ::close(fd);
        continue;
      }
      ++connections_;
      open_.push_back(fd);
      if (garbage) connecting.push_back({fd, POLLOUT, 0});
    }
    if (connecting.empty()) return;
    ::poll(connecting.data(), connecting.size(), 200);
    for (const pollfd& entry : connecting) {
      if (!(entry.revents & POLLOUT)) continue;
      uint8_t bytes[64];
      for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(random_());
      (void)!::send(entry.fd, bytes, sizeof bytes, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
  }

  std::vector<Target> targets_;
  int idle_;
  int garbage_;
  double wave_s_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> connections_{0};
  mutable std::mutex mutex_;
  std::set<ListeningPort> seen_;
  std::vector<int> open_;
  std::minstd_rand random_{12345};
  std::thread thread_;
};

}  // namespace kolo::test
