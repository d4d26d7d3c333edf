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
#include <mutex>
#include <string>

#include "ring/ring.hpp"

namespace kolo {

struct Config;
class StoreClient;
struct StoreLimits;
struct TransportSettings;
struct PreparedMesh;
class StoreServer;

// A new connection to the store that rank 0 serves at config.addr, authenticated with the job's
// secret. A store client is not thread-safe: each thread that connects a group opens its own.
// Under PMIx (Config::pmix_rendezvous) the client connects at its first request, and in the
// process that reserved the store's port (ReservedStore) it starts serving the store first.
std::unique_ptr<StoreClient> open_store(const Config& config);

// Rank 0's store under PMIx, where the job starts without one: a port bound at start-up (not
// listening, so that nothing serves and no stranger can connect), whose address goes into rank
// 0's PMIx record; the store serves there from the first time this process needs it: a split, the
// fusion engine, GPU set-up, or a transport that exchanges through the store. Each such use
// is collective on a communicator that has world rank 0's process as a member or parent member,
// so the other ranks, which connect retrying until KOLO_TIMEOUT, find it served in time.
class ReservedStore {
 public:
  // Binds a free port on every IPv4 interface; throws kolo::Error(kSystem) naming the error.
  explicit ReservedStore(const Config& config);
  ~ReservedStore();
  ReservedStore(const ReservedStore&) = delete;
  ReservedStore& operator=(const ReservedStore&) = delete;

  uint16_t port() const { return port_; }
  // Starts serving at the port, once; returns the server (shared with the communicators that
  // keep it). Thread-safe. Throws kolo::Error(kSystem) when listen() fails.
  std::shared_ptr<StoreServer> serve();

 private:
  std::mutex mutex_;
  std::string secret_;
  double timeout_s_;
  uint64_t generation_;
  uint16_t port_ = 0;
  int fd_ = -1;  // the bound socket, until the server takes it
  std::shared_ptr<StoreServer> server_;
};

// Registers a ReservedStore made for config (rank 0's, under PMIx) so that open_store finds it.
std::shared_ptr<ReservedStore> reserve_store(const Config& config);
// The server of the store this process reserved at config.addr's port, started now if it was
// not yet; null where this process reserved none there.
std::shared_ptr<StoreServer> serve_reserved_store(const Config& config);

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
// With `prepared`, the transport's first mesh takes its listener and the peers' addresses from
// there instead of the store (transport/mesh.hpp).
Links connect_links(const Config& config, StoreClient& store, uint64_t context, Waiter waiter,
                    const std::string& listen_host = {},
                    std::shared_ptr<PreparedMesh> prepared = nullptr);

}  // namespace kolo
