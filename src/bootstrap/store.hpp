// The rendezvous store: a small key-value service that rank 0 serves and that every rank (rank 0
// included) uses to exchange listening addresses and other start-up facts.
//
// Protocol: after authentication (net/auth.hpp, purpose kPurposeStore) a client sends requests and
// reads one response each. One request may wait for many keys and return all their values
// (get_many, get_all), so that a rank reads what every other rank published in one round trip.
// Keys are at most 4 KiB and values at most 16 MiB; longer lengths read from the wire drop the
// connection (logged) before anything is allocated.
//
// Bounds (StoreLimits; docs/errors.md, "What fails, and how", lists the defaults): connections that
// have not yet authenticated are capped, the oldest dropped to make room for a new one, so
// strangers cannot take rank 0's descriptors; warnings about strangers are rate-limited; the keys
// stored and their bytes are capped, a SET or ADD beyond either refused with an error that says so;
// a parked GET or WAIT is forgotten when its connection closes, and answered with a timeout after
// park_seconds if its keys have not appeared by then, so that a client that never gives up holds
// nothing forever. Authenticated connections are not capped: each belongs to a rank of the job.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "net/socket.hpp"

namespace kolo {

inline constexpr size_t kStoreMaxKeyBytes = 4096;
inline constexpr size_t kStoreMaxValueBytes = 16u << 20;

// What the server holds at most. The defaults are generous for a job (a communicator stores a few
// short keys per rank) and small next to rank 0's memory and descriptors.
struct StoreLimits {
  size_t unauthenticated = 64;      // connections still in the handshake
  size_t keys = size_t{1} << 20;    // keys stored
  size_t bytes = size_t{256} << 20;  // keys and values together
  // How long a GET or WAIT may wait for its keys on the server; longer than the clients' own
  // timeouts (rank 0 makes it at least twice KOLO_TIMEOUT), which normally end a wait first.
  double park_seconds = 3600;
  // The generation clients must name (StoreClient's generation): a client of another one is
  // turned away at the handshake; one that names none (0: a tool, a test) is admitted.
  // Config::store_generation says why.
  uint64_t generation = 0;
};

// A snapshot of what the server holds, published by its thread after every round of events.
struct StoreStats {
  size_t keys = 0;
  size_t bytes = 0;             // keys and values together
  size_t waiters = 0;           // (connection, key) pairs of parked GETs and WAITs
  size_t connections = 0;       // authenticated and not
  size_t unauthenticated = 0;
  uint64_t strangers_dropped = 0;  // connections dropped before or at authentication
};

// Serves the store from a background thread until destroyed. Any number of clients; a client that
// fails authentication or sends a malformed frame is dropped and logged, others carry on.
class StoreServer {
 public:
  // Binds endpoint (port 0 picks one). Throws kolo::Error(kSystem) naming the address on failure.
  StoreServer(const net::Endpoint& endpoint, std::string secret, StoreLimits limits = {});
  // Serves on a socket that already listens: one its launcher bound and handed down, so that no
  // other process could take the port between the launcher's choice and the server's start.
  StoreServer(net::Socket listener, std::string secret, StoreLimits limits = {});
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  net::Endpoint endpoint() const;  // the bound address (with the real port)
  StoreStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A connection to the store. Not thread-safe: one caller at a time.
class StoreClient {
 public:
  // Connects (retrying until the server is up and serves generation: see StoreLimits) and
  // authenticates, within timeout_s.
  StoreClient(const net::Endpoint& endpoint, const std::string& secret, int rank, double timeout_s,
              uint64_t generation = 0);
  // A client that connects at its first request instead, calling before_first_request (if set)
  // once just before: for a store whose server starts only when some rank first needs it (under
  // PMIx the job starts without one, comm/connect.hpp), so that a client nobody uses costs
  // nothing.
  struct Deferred {
    std::function<void()> before_first_request;
  };
  StoreClient(const net::Endpoint& endpoint, const std::string& secret, int rank, double timeout_s,
              uint64_t generation, Deferred deferred);
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void set(const std::string& key, const std::vector<uint8_t>& value);
  // Waits until key exists, then returns its value; kolo::Error(kTimeout) naming the key after
  // the timeout given at construction, or at the server's park_seconds if that comes first.
  std::vector<uint8_t> get(const std::string& key);
  // One GET_MANY: waits on the server until every key exists or wait_s passes (at most the
  // client's timeout), then returns each key's value in the order of keys, nullopt for a key that
  // did not exist then. At most 65,536 keys, their values together at most 64 MiB; more is
  // kolo::Error(kInvalidArgument) naming the keys.
  std::vector<std::optional<std::vector<uint8_t>>> get_many(const std::vector<std::string>& keys,
                                                             double wait_s);
  // Waits until every key exists and returns their values in the order of keys, in as few
  // requests as it can: one GET_MANY when the keys exist within a second, then GET_MANYs of the
  // keys still missing, each waiting longer (up to 10 s), until the client's timeout. A timeout
  // throws kolo::Error(kTimeout) naming the keys still missing, and any other failure (the store
  // went away) rethrows it; before either, *missing (if given) is set to the indices into keys
  // of those that had not appeared as of the last answer, so that a caller can name what it
  // waited for (every key's index until an answer came).
  std::vector<std::vector<uint8_t>> get_all(const std::vector<std::string>& keys,
                                            std::vector<size_t>* missing = nullptr);
  // Waits until every key exists.
  void wait(const std::vector<std::string>& keys);
  // Atomically adds delta to the integer stored at key (missing counts as 0); returns the sum.
  int64_t add(const std::string& key, int64_t delta);
  // Erases every key that starts with prefix (1..kStoreMaxKeyBytes bytes); returns how many.
  uint64_t erase_prefix(const std::string& prefix);
  // Erases exactly these keys (those that exist); returns how many. For keys no rank will read
  // again, such as those a split's members wrote to connect (comm/split.cpp).
  uint64_t erase(const std::vector<std::string>& keys);

  // From now on, remembers every key this client sets or adds, for a caller that erases them
  // once no rank reads them again.
  void remember_written_keys();
  // The keys remembered, each once, in the order first written; stops remembering.
  std::vector<std::string> take_written_keys();

  // The requests this client has sent so far (each call of set, get, wait, add, erase, ...
  // that reached the server is one), for start-up statistics.
  uint64_t requests() const;

  // Convenience for text values.
  void set_string(const std::string& key, const std::string& value);
  std::string get_string(const std::string& key);
  std::vector<std::string> get_all_strings(const std::vector<std::string>& keys,
                                           std::vector<size_t>* missing = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Every key kolo writes to the store is made here: "kolo/<context in hex>/<what>", with "/<rank>"
// after it for an item of one rank. The context tells communicators apart (the world's, each
// split's), so that their start-ups never read each other's keys.
std::string store_key(uint64_t context, std::string_view what);
std::string store_key(uint64_t context, std::string_view what, int rank);

}  // namespace kolo
