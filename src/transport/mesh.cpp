#include "transport/mesh.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <exception>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include "bootstrap/store.hpp"
#include "core/log.hpp"
#include "kolo/status.hpp"
#include "net/auth.hpp"
#include "net/gate.hpp"
#include "transport/transport.hpp"

namespace kolo {
namespace {

// Where connection `stream` of `peer` is kept among every lower rank's connections.
size_t slot_of(int peer, int stream, int data_streams) {
  return static_cast<size_t>(peer) * (static_cast<size_t>(data_streams) + 1) +
         static_cast<size_t>(stream);
}

// Connection `stream` of a peer: 0 .. data_streams-1 carry data, data_streams is the control one.
void place(PeerSockets& peer, int stream, int data_streams, net::Socket socket) {
  if (stream == data_streams) {
    peer.control = std::move(socket);
  } else {
    peer.data[stream] = std::move(socket);
  }
}

// Accepts the connections of every lower rank through a Gate (net/gate.hpp): `rank` of them per
// data stream and control. A connection that says it is one this rank already holds replaces it:
// only a peer that knows the secret can say so, and it tries again only when its first attempt
// failed on its side.
void accept_connections(net::Gate& gate, int rank, int data_streams,
                        const Deadline& deadline, const std::atomic<bool>& stop,
                        std::map<size_t, std::pair<net::Hello, net::Socket>>& accepted) {
  const size_t expected = static_cast<size_t>(rank) * (static_cast<size_t>(data_streams) + 1);
  while (accepted.size() < expected) {
    if (stop) return;
    if (deadline.expired()) {
      throw Error(Status::kTimeout,
                  fmt::format("rank {} timed out waiting for lower ranks to connect ({} of {} "
                              "connections arrived)",
                              rank, accepted.size(), expected));
    }
    int wait_ms = std::min(100, deadline.remaining_ms());
    if (gate.timeout_ms() >= 0) wait_ms = std::min(wait_ms, gate.timeout_ms());
    pollfd entry{gate.fd(), POLLIN, 0};
    ::poll(&entry, 1, wait_ms);
    for (net::Gate::Admitted& admitted : gate.advance()) {
      const net::Hello& hello = admitted.hello;
      const int stream = hello.purpose == net::kPurposeControl ? data_streams
                                                                 : static_cast<int>(hello.stream);
      net::set_nonblocking(admitted.socket, false);
      accepted[slot_of(hello.rank, stream, data_streams)] = {hello, std::move(admitted.socket)};
    }
  }
}

// Who may connect: a lower rank of this communicator, once per data stream and control.
std::string unexpected_hello(const net::Hello& hello, uint64_t context, int rank,
                             int data_streams) {
  const bool control = hello.purpose == net::kPurposeControl;
  if (hello.context != context) {
    return fmt::format("for another communicator ({:x}, not {:x})", hello.context, context);
  }
  if (hello.rank < 0 || hello.rank >= rank ||
      !(control || (hello.purpose == net::kPurposeData &&
                    hello.stream < static_cast<uint32_t>(data_streams)))) {
    return fmt::format("says it is rank {} stream {} purpose {}, which this rank does not expect",
                       hello.rank, hello.stream, hello.purpose);
  }
  return {};
}

// The address this rank listens on and publishes: the one its host sends from to reach rank 0's
// store. A rank that reaches the store over loopback shares rank 0's host, and a host name in
// KOLO_ADDR may resolve to loopback there (Debian maps its own name to 127.0.1.1) while other
// hosts reach it over the network: such a rank takes the interface that routes to the first rank
// that published a network address, so that no peer on another host is handed a loopback address.
std::string listen_address(const TransportSettings& settings, StoreClient& store, int rank,
                           int size, uint64_t context, const char* name) {
  const std::string own = store_route(settings);
  std::string route_name = fmt::format("{}-route", name);
  store.set_string(store_key(context, route_name, rank), own);
  if (!net::is_loopback_address(own)) return own;
  std::vector<int> peers;
  std::vector<std::string> keys;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    peers.push_back(peer);
    keys.push_back(store_key(context, route_name, peer));
  }
  const std::vector<std::string> routes = store.get_all_strings(keys);
  std::vector<std::pair<int, std::string>> others;
  for (size_t i = 0; i < routes.size(); ++i) others.emplace_back(peers[i], routes[i]);
  return listen_host_from_routes(settings, own, others);
}

}  // namespace

std::string store_route(const TransportSettings& settings) {
  return net::route_source_address(net::parse_endpoint(settings.addr, "KOLO_ADDR"), "KOLO_ADDR");
}

std::string listen_host_from_routes(const TransportSettings& settings, const std::string& own,
                                    const std::vector<std::pair<int, std::string>>& others) {
  if (!settings.socket_ifname.empty()) return net::interface_address(settings.socket_ifname);
  if (!net::is_loopback_address(own)) return own;
  for (const auto& [peer, route] : others) {
    if (!net::is_loopback_address(route)) {
      return net::route_source_address({route, 0}, fmt::format("the address of rank {}", peer));
    }
  }
  return own;
}

std::string mesh_listen_host(const TransportSettings& settings, StoreClient& store, int rank,
                             int size, uint64_t context, const char* name) {
  if (!settings.listen_host.empty()) return settings.listen_host;
  return !settings.socket_ifname.empty()
             ? net::interface_address(settings.socket_ifname)
             : listen_address(settings, store, rank, size, context, name);
}

std::vector<PeerSockets> connect_mesh(const TransportSettings& settings, StoreClient& store,
                                      int rank, int size, uint64_t context, const char* name,
                                      int data_streams) {
  Deadline deadline(settings.timeout_s);
  // The listener and the addresses the caller exchanged already, if any (PreparedMesh).
  net::Socket listener;
  std::vector<std::string> prepared_addresses;
  if (settings.prepared && settings.prepared->listener.valid()) {
    listener = std::move(settings.prepared->listener);
    prepared_addresses = settings.prepared->addresses;
  } else {
    listener = net::listen_on({mesh_listen_host(settings, store, rank, size, context, name), 0});
  }
  const bool prepared = !prepared_addresses.empty();
  net::Gate gate(std::move(listener), settings.secret, name, [&](const net::Hello& hello) {
    return unexpected_hello(hello, context, rank, data_streams);
  });
  const net::Endpoint& me = gate.endpoint();
  if (!prepared) store.set_string(store_key(context, name, rank), me.to_string());
  if (data_streams > 0) {
    log::info("{}: rank {} listens on {} with {} data stream(s) per peer", name, rank,
              me.to_string(), data_streams);
  } else {
    log::info("{}: rank {} listens on {} for control connections", name, rank, me.to_string());
  }

  std::vector<PeerSockets> peers(size);
  for (auto& peer : peers) peer.data.resize(data_streams);

  // Lower ranks connect to us while we connect to higher ranks.
  std::atomic<bool> stop{false};
  std::exception_ptr accept_error;
  std::map<size_t, std::pair<net::Hello, net::Socket>> accepted;
  std::thread acceptor([&] {
    try {
      accept_connections(gate, rank, data_streams, deadline, stop, accepted);
    } catch (...) {
      accept_error = std::current_exception();
    }
  });
  std::exception_ptr connect_error;
  try {
    // Every higher rank's address, in one request.
    std::vector<std::string> addresses;
    if (prepared) {
      addresses.assign(prepared_addresses.begin() + rank + 1, prepared_addresses.end());
    } else {
      std::vector<std::string> keys;
      for (int peer = rank + 1; peer < size; ++peer) keys.push_back(store_key(context, name, peer));
      addresses = store.get_all_strings(keys);
    }
    for (int peer = rank + 1; peer < size; ++peer) {
      net::Endpoint endpoint = net::parse_endpoint(addresses[static_cast<size_t>(peer - rank - 1)],
                                                   "the address published by a peer");
      for (int stream = 0; stream <= data_streams; ++stream) {
        bool control = stream == data_streams;
        net::Hello hello{control ? net::kPurposeControl : net::kPurposeData, rank,
                         static_cast<uint32_t>(stream), context};
        place(peers[peer], stream, data_streams,
              net::connect_authenticated(endpoint, settings.secret, hello, deadline));
      }
    }
  } catch (...) {
    connect_error = std::current_exception();
    stop = true;
  }
  acceptor.join();
  if (connect_error) std::rethrow_exception(connect_error);
  if (accept_error) std::rethrow_exception(accept_error);
  for (auto& [slot, connection] : accepted) {
    auto& [hello, socket] = connection;
    int stream =
        hello.purpose == net::kPurposeControl ? data_streams : static_cast<int>(hello.stream);
    place(peers[hello.rank], stream, data_streams, std::move(socket));
  }
  return peers;
}

}  // namespace kolo
