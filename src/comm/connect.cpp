// Wiring store -> transport -> ring (comm/connect.hpp).
#include "comm/connect.hpp"

#include "bootstrap/store.hpp"
#include "core/config.hpp"
#include "net/socket.hpp"
#include "transport/transport.hpp"

namespace kolo {

std::unique_ptr<StoreClient> open_store(const Config& config) {
  return std::make_unique<StoreClient>(net::parse_endpoint(config.addr, "KOLO_ADDR"), config.secret,
                                       config.rank, config.timeout_s);
}

Links connect_links(const Config& config, StoreClient& store, uint64_t context) {
  Links links;
  links.transport = make_transport(config, store, config.rank, config.size, context);
  links.ring = std::make_unique<Ring>(*links.transport, config.rank, config.size,
                                      config.segment_bytes, config.timeout_s);
  return links;
}

}  // namespace kolo
