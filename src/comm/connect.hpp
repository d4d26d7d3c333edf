// Connecting a group of ranks: the one place where the rendezvous store, a transport and the ring
// schedules are wired together, for the world communicator, each member of a split and each
// fusion engine.
//
// Contract: every rank of the group calls connect_links() with the same size and context (which
// tells the group's store keys and connection hellos apart from every other group's); it blocks
// until this rank is connected to every peer, or throws kolo::Error (a peer that never came, a
// stranger, KOLO_TRANSPORT naming no transport) after at most the configured timeout.
#pragma once

#include <cstdint>
#include <memory>

#include "ring/ring.hpp"

namespace kolo {

struct Config;
class StoreClient;
struct StoreLimits;
struct TransportSettings;

// A new connection to the store that rank 0 serves at config.addr, authenticated with the job's
// secret. A store client is not thread-safe: each thread that connects a group opens its own.
std::unique_ptr<StoreClient> open_store(const Config& config);

// The limits of a store that a rank of this job serves: the defaults, with a parked request's
// limit at least twice KOLO_TIMEOUT, so that a rank's own timeout always ends its wait first.
StoreLimits store_limits(const Config& config);

// What a transport is told of the configuration (transport/transport.hpp).
TransportSettings transport_settings(const Config& config);

// Whose thread waits on a group's connections: the application's (the communicator's collective
// calls) or the fusion engine's, which yields its CPU at once while it waits
// (TransportSettings::yield_at_once).
enum class Waiter { kApplication, kFusionEngine };

// Where this rank of the group listens, its transport and its lifeline alike: KOLO_SOCKET_IFNAME's
// address, or the one its host routes to the store from (transport/mesh.hpp), agreed with the
// group in one exchange under the context. Collective, as connect_links.
std::string listen_host(const Config& config, StoreClient& store, uint64_t context);

// This rank's transport to every peer of the group (config.rank of config.size, the transport
// that config.transport names), and the ring over it. The transport listens on listen_host, or
// where it finds itself when that is empty.
Links connect_links(const Config& config, StoreClient& store, uint64_t context, Waiter waiter,
                    const std::string& listen_host = {});

}  // namespace kolo
