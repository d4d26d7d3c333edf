// Wiring store -> transport -> ring (comm/connect.hpp).
#include "comm/connect.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <utility>

#include "bootstrap/store.hpp"
#include "core/config.hpp"
#include "core/host.hpp"
#include "core/log.hpp"
#include "core/topology.hpp"
#include "net/socket.hpp"
#include "transport/mesh.hpp"
#include "transport/transport.hpp"

namespace kolo {

namespace {

// The stores this process reserved, by port, for as long as a communicator holds one.
std::mutex g_reserved_mutex;
std::map<uint16_t, std::weak_ptr<ReservedStore>> g_reserved;

}  // namespace

std::unique_ptr<StoreClient> open_store(const Config& config) {
  const net::Endpoint endpoint = net::parse_endpoint(config.addr, "KOLO_ADDR");
  if (config.pmix_rendezvous) {
    StoreClient::Deferred deferred;
    deferred.before_first_request = [config] { (void)serve_reserved_store(config); };
    return std::make_unique<StoreClient>(endpoint, config.secret, config.rank, config.timeout_s,
                                         config.store_generation, std::move(deferred));
  }
  return std::make_unique<StoreClient>(endpoint, config.secret, config.rank, config.timeout_s,
                                       config.store_generation);
}

ReservedStore::ReservedStore(const Config& config)
    : secret_(config.secret), timeout_s_(config.timeout_s), generation_(config.store_generation) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof address;
  // No SO_REUSEADDR: while the socket does not listen, a socket of another process with that
  // option could otherwise bind the same port, and take it.
  if (fd_ < 0 ||
      ::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const int error = errno;
    if (fd_ >= 0) ::close(fd_);
    throw Error(Status::kSystem,
                fmt::format("kolo: rank 0 could not bind a port for the rendezvous store: {}",
                            std::strerror(error)));
  }
  port_ = ntohs(address.sin_port);
}

ReservedStore::~ReservedStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::shared_ptr<StoreServer> ReservedStore::serve() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (server_) return server_;
  if (::listen(fd_, 128) != 0) {
    throw Error(Status::kSystem,
                fmt::format("kolo: rank 0 could not serve the rendezvous store at port {}: "
                            "listen: {}",
                            port_, std::strerror(errno)));
  }
  Config limits_of;
  limits_of.timeout_s = timeout_s_;
  limits_of.store_generation = generation_;
  server_ = std::make_shared<StoreServer>(net::Socket(std::exchange(fd_, -1)), secret_,
                                          store_limits(limits_of));
  log::info("serving the rendezvous store at port {}, first needed now", port_);
  return server_;
}

std::shared_ptr<ReservedStore> reserve_store(const Config& config) {
  auto reserved = std::make_shared<ReservedStore>(config);
  std::lock_guard<std::mutex> lock(g_reserved_mutex);
  g_reserved[reserved->port()] = reserved;
  return reserved;
}

std::shared_ptr<StoreServer> serve_reserved_store(const Config& config) {
  if (config.addr.empty()) return nullptr;
  const net::Endpoint endpoint = net::parse_endpoint(config.addr, "KOLO_ADDR");
  std::shared_ptr<ReservedStore> reserved;
  {
    std::lock_guard<std::mutex> lock(g_reserved_mutex);
    auto found = g_reserved.find(endpoint.port);
    if (found == g_reserved.end()) return nullptr;
    reserved = found->second.lock();
    if (!reserved) {
      g_reserved.erase(found);
      return nullptr;
    }
  }
  return reserved->serve();
}

StoreLimits store_limits(const Config& config) {
  StoreLimits limits;
  limits.park_seconds = std::max(limits.park_seconds, 2 * config.timeout_s);
  limits.generation = config.store_generation;
  return limits;
}

TransportSettings transport_settings(const Config& config) {
  TransportSettings settings;
  settings.transport = config.transport;
  settings.addr = config.addr;
  settings.secret = config.secret;
  settings.timeout_s = config.timeout_s;
  settings.socket_ifname = config.socket_ifname;
  settings.host = host_identity(config);
  settings.local_size = config.local_size;
  settings.own_core =
      config.bind == "core" && config.local_size > 0 && config.local_size <= local_topology().cores;
  settings.tcp_streams = config.tcp_streams;
  settings.tcp_congestion = config.tcp_congestion;
  settings.shm = config.shm;
  settings.shm_copy = config.shm_copy;
  return settings;
}

std::string listen_host(const Config& config, StoreClient& store, uint64_t context) {
  return mesh_listen_host(transport_settings(config), store, config.rank, config.size, context,
                          "listen");
}

Links connect_links(const Config& config, StoreClient& store, uint64_t context, Waiter waiter,
                    const std::string& listen_host, std::shared_ptr<PreparedMesh> prepared) {
  TransportSettings settings = transport_settings(config);
  settings.prepared = std::move(prepared);
  settings.yield_at_once = waiter == Waiter::kFusionEngine;
  settings.listen_host = listen_host;
  Links links;
  links.transport = make_transport(settings, store, config.rank, config.size, context);
  links.ring = std::make_unique<Ring>(*links.transport, config.rank, config.size,
                                      config.segment_bytes, config.timeout_s);
  return links;
}

}  // namespace kolo
