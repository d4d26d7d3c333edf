// Wiring store -> transport -> ring (comm/connect.hpp).
#include "comm/connect.hpp"

#include <algorithm>

#include "bootstrap/store.hpp"
#include "core/config.hpp"
#include "core/host.hpp"
#include "core/topology.hpp"
#include "net/socket.hpp"
#include "transport/mesh.hpp"
#include "transport/transport.hpp"

namespace kolo {

std::unique_ptr<StoreClient> open_store(const Config& config) {
  return std::make_unique<StoreClient>(net::parse_endpoint(config.addr, "KOLO_ADDR"), config.secret,
                                       config.rank, config.timeout_s, config.store_generation);
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
                    const std::string& listen_host) {
  TransportSettings settings = transport_settings(config);
  settings.yield_at_once = waiter == Waiter::kFusionEngine;
  settings.listen_host = listen_host;
  Links links;
  links.transport = make_transport(settings, store, config.rank, config.size, context);
  links.ring = std::make_unique<Ring>(*links.transport, config.rank, config.size,
                                      config.segment_bytes, config.timeout_s);
  return links;
}

}  // namespace kolo
