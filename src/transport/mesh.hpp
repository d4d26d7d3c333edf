// Authenticated TCP connections between every pair of ranks, set up through the rendezvous store.
//
// Every rank listens on the interface that routes to the store (or KOLO_SOCKET_IFNAME, or the
// host the caller agreed on: TransportSettings::listen_host) and publishes the address under
// kolo/<context>/<name>/<rank>, then reads every higher rank's in one request
// (StoreClient::get_all). The lower rank of each pair connects, the higher one accepts, and every
// socket proves the job secret (net/auth.hpp) and says which rank, purpose and stream it is
// before it is used. The accepting side admits through a Gate
// (net/gate.hpp), so strangers that connect delay and refuse no peer; the connecting side tries
// again when pushed out. The listener is closed once the mesh is complete.
//
// The TCP transport asks for its data streams and a control connection per peer; the UCX
// transport only for the control connection (its data goes through UCX).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "net/socket.hpp"

namespace kolo {

class StoreClient;
struct TransportSettings;

// What a group that exchanged its start-up records in one round of its own (the world communicator
// under PMIx, comm/communicator.cpp) hands the transport instead of the store exchange: a socket
// already listening, every rank's address of it ("host:port", in rank order, this rank's
// included), and every rank's transport_auto_facts (transport.hpp) for KOLO_TRANSPORT=auto. The
// first connect_mesh takes the listener; a later one (another mesh of the same settings) goes
// through the store.
struct PreparedMesh {
  net::Socket listener;
  std::vector<std::string> addresses;
  std::vector<std::string> auto_facts;
};

struct PeerSockets {
  std::vector<net::Socket> data;  // data_streams connected, authenticated, blocking sockets
  net::Socket control;            // the control connection (see control_channel.hpp)
};

// Returns one entry per rank; this rank's own entry is empty. `name` keys the published address
// and prefixes log lines ("tcp", "ucx"). Throws kolo::Error: kTimeout when peers do not show up
// within settings.timeout_s, kPeerLost when a peer drops a connection during set-up.
std::vector<PeerSockets> connect_mesh(const TransportSettings& settings, StoreClient& store,
                                      int rank, int size, uint64_t context, const char* name,
                                      int data_streams);

// The address this rank listens on for connections from its peers (settings.listen_host if set,
// else KOLO_SOCKET_IFNAME's, else the one its host routes to the store from; see mesh.cpp),
// published under `name`'s route key. Collective in the same way as connect_mesh.
std::string mesh_listen_host(const TransportSettings& settings, StoreClient& store, int rank,
                             int size, uint64_t context, const char* name);

// The two halves of mesh_listen_host, for a caller that exchanges the routes with other facts in
// one record (the world communicator's host discovery): the address this rank's host sends from
// to reach the store (KOLO_ADDR), and where to listen given it and the other ranks' (rank,
// route), in rank order.
std::string store_route(const TransportSettings& settings);
std::string listen_host_from_routes(const TransportSettings& settings, const std::string& own,
                                    const std::vector<std::pair<int, std::string>>& others);

}  // namespace kolo
