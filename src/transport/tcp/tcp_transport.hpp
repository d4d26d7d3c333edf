// TCP transport: a full mesh of authenticated sockets, driven by one edge-triggered epoll set.
#pragma once

#include <memory>

#include "transport/transport.hpp"

namespace kolo {

std::unique_ptr<Transport> make_tcp_transport(const TransportSettings& settings, StoreClient& store,
                                              int rank, int size, uint64_t context);

}  // namespace kolo
