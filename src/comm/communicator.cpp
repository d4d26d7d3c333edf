#include "comm/communicator.hpp"

#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <vector>

#include "bootstrap/pmix.hpp"
#include "bootstrap/store.hpp"
#include "comm/connect.hpp"
#include "comm/lifeline.hpp"
#include "comm/report.hpp"
#include "core/arguments.hpp"
#include "core/build_info.hpp"
#include "core/deadline.hpp"
#include "core/host.hpp"
#include "core/log.hpp"
#include "core/topology.hpp"
#include "fusion/engine.hpp"
#include "gpu/backend.hpp"
#include "gpu/gpu.hpp"
#include "net/socket.hpp"
#include "ring/ring.hpp"
#include "transport/mesh.hpp"
#include "transport/transport.hpp"

namespace kolo {
namespace {

// The world communicator's connections and store keys are told apart from those of others by
// this number.
constexpr uint64_t kWorldContext = 1;

// The listening socket that rank 0's launcher bound at the store's port and handed down in
// KOLO_STORE_FD (kolorun does), so that no other process could take the port before the store
// starts; invalid when there is none. The first communicator of the process that serves at that
// port takes it; a communicator at another address (one the caller chose) leaves it alone, and
// one after the first (which closed it when destroyed) binds the port itself.
net::Socket inherited_store_socket(const Config& config, const net::Endpoint& store) {
  static std::atomic<bool> taken{false};
  if (config.store_fd < 0 || taken.load()) return {};
  net::Socket socket = net::adopt_listener(config.store_fd, "KOLO_STORE_FD");
  const net::Endpoint bound = net::local_endpoint(socket);
  if (bound.port != store.port || taken.exchange(true)) {
    log::info("the socket of KOLO_STORE_FD={} listens at {}, not at the store's address {}: the "
              "store binds its own",
              config.store_fd, bound.to_string(), config.addr);
    (void)socket.release();  // the launcher's, for another communicator
    return {};
  }
  return socket;
}

// The number of communicators made at addr as rank in this process so far, this one included
// (Config::store_generation): every rank of a job makes them in the same order, so the numbers
// agree without being exchanged. Counted per rank, so that ranks that are threads of one process
// (as in tests) count their own.
uint64_t next_store_generation(const std::string& addr, int rank) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, int>, uint64_t> made;
  std::lock_guard<std::mutex> lock(mutex);
  return ++made[{addr, rank}];
}

// KOLO_ALLREDUCE must agree because the allreduce schedule follows from it: ranks that ran
// different schedules would wait for messages that never come.
Error modes_differ(const std::vector<std::string>& modes, int rank) {
  return Error(Status::kConfig,
               fmt::format("kolo: KOLO_ALLREDUCE is {} on rank 0 but {} on rank {}: it must be "
                           "the same on every rank, as the allreduce schedule follows from it",
                           modes[0], modes[static_cast<size_t>(rank)], rank));
}

// The address `host` (KOLO_ADDR's host) resolves to here, numeric: where this rank reaches the
// store. Throws kolo::Error(kConfig) naming it when it does not resolve.
std::string numeric_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw Error(Status::kConfig, fmt::format("kolo: the host of KOLO_ADDR, '{}', does not resolve: "
                                             "{}",
                                             host, ::gai_strerror(rc)));
  }
  char text[NI_MAXHOST] = {};
  const int named = ::getnameinfo(found->ai_addr, found->ai_addrlen, text, sizeof text, nullptr, 0,
                                  NI_NUMERICHOST);
  ::freeaddrinfo(found);
  if (named != 0) {
    throw Error(Status::kConfig, fmt::format("kolo: the host of KOLO_ADDR, '{}': getnameinfo: {}",
                                             host, ::gai_strerror(named)));
  }
  return text;
}

// The name of this host's only interface that is up, not loopback and has an address; empty when
// there is none or several.
std::string only_network_interface() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string only;
  bool several = false;
  for (const ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || (entry->ifa_flags & IFF_UP) == 0 ||
        (entry->ifa_flags & IFF_LOOPBACK) != 0 ||
        (entry->ifa_addr->sa_family != AF_INET && entry->ifa_addr->sa_family != AF_INET6)) {
      continue;
    }
    if (only.empty()) {
      only = entry->ifa_name;
    } else if (only != entry->ifa_name) {
      several = true;
    }
  }
  ::freeifaddrs(list);
  return several ? std::string() : only;
}

// A start-up record: one line per field. Throws kolo::Error(kConfig) for a field with a line
// break (a host identity or address never holds one; this is a guard).
std::string join_record(const std::vector<std::string>& fields, int rank) {
  std::string record;
  for (const std::string& field : fields) {
    if (field.find('\n') != std::string::npos) {
      throw Error(Status::kConfig,
                  fmt::format("kolo: rank {}: a start-up record field holds a line break: {:?}",
                              rank, field));
    }
    record += (record.empty() ? "" : "\n") + field;
  }
  return record;
}

// The fields of rank `of`'s record as this rank read it `through` the store or PMIx; a record of
// another number of fields comes from another kolo (kolo::Error(kConfig)).
std::vector<std::string> split_record(const std::string& record, size_t expected,
                                      const Config& config, int of, const char* through) {
  std::vector<std::string> fields;
  for (size_t at = 0;;) {
    const size_t newline = record.find('\n', at);
    fields.push_back(record.substr(at, newline == std::string::npos ? newline : newline - at));
    if (newline == std::string::npos) break;
    at = newline + 1;
  }
  if (fields.size() != expected) {
    throw Error(Status::kConfig,
                fmt::format("kolo: rank {} of {}: rank {}'s start-up record {} has {} fields, not "
                            "{}: is every rank the same kolo?",
                            config.rank, config.size, of, through, fields.size(), expected));
  }
  return fields;
}

// Every rank's start-up record as read through the store or PMIx, one vector a field in rank
// order. Both start-ups write the same five fields first (start_through_store lists them); PMIx
// adds the store's address, which only rank 0's record holds.
struct StartupRecords {
  std::vector<std::string> modes;       // KOLO_ALLREDUCE
  std::vector<std::string> identities;  // host identity
  std::vector<std::string> addresses;   // the transport's listening address
  std::vector<std::string> lifelines;   // the lifeline's listening address
  std::vector<std::string> auto_facts;  // what KOLO_TRANSPORT=auto decides from
  std::string store_address;            // rank 0's sixth field, with_store_address only
};

// Splits `records` (one per rank) read `through` the store or PMIx; each must have five fields, or
// six `with_store_address` (kolo::Error(kConfig) otherwise, from split_record).
StartupRecords read_startup_records(const std::vector<std::string>& records,
                                    bool with_store_address, const Config& config,
                                    const char* through) {
  const size_t expected = with_store_address ? 6 : 5;
  StartupRecords read;
  for (int rank = 0; rank < config.size; ++rank) {
    const std::vector<std::string> fields =
        split_record(records[static_cast<size_t>(rank)], expected, config, rank, through);
    read.modes.push_back(fields[0]);
    read.identities.push_back(fields[1]);
    read.addresses.push_back(fields[2]);
    read.lifelines.push_back(fields[3]);
    read.auto_facts.push_back(fields[4]);
    if (with_store_address && rank == 0) read.store_address = fields[5];
  }
  return read;
}

}  // namespace

HostFacts read_host_facts(const std::vector<std::string>& modes,
                          const std::vector<std::string>& identities, int rank) {
  HostFacts facts;
  std::map<std::string, int> numbers;
  const std::string& mine = identities[static_cast<size_t>(rank)];
  for (size_t other = 0; other < identities.size(); ++other) {
    const std::string& identity = identities[other];
    facts.host_of.push_back(
        numbers.emplace(identity, static_cast<int>(numbers.size())).first->second);
    if (identity == mine) {
      if (static_cast<int>(other) < rank) ++facts.local_rank;
      ++facts.local_size;
    }
    if (facts.differs < 0 && modes[other] != modes[0]) facts.differs = static_cast<int>(other);
  }
  facts.nodes = static_cast<int>(numbers.size());
  return facts;
}

Communicator::Communicator(const ConfigOverrides& overrides) {
  const Clock::time_point started = Clock::now();
  std::vector<std::string> unknown;
  config_ = resolve_config(overrides, process_environment(), &unknown);
  log::set_rank(config_.rank);
  for (const auto& name : unknown) {
    log::warn("unknown variable {} ignored (docs/environment.md lists the KOLO_* variables)", name);
  }
  if (config_.launcher == kNoLauncher) {
    log::info("no launcher found (no KOLO_RANK, and none of mpirun's, srun's or torchrun's "
              "variables): this process is a world of one");
  }
  if (config_.secret.empty()) {
    // Once per job, at WARN: without a secret, anyone who reaches the job's ports can join it.
    constexpr const char* kNoSecret =
        "no job secret (KOLO_SECRET or KOLO_SECRET_FILE): connections prove an empty secret, so "
        "anyone who can reach this job's ports can join it or read its data; kolorun sets one, and "
        "under mpirun, srun or torchrun KOLO_SECRET_FILE can name a file on a shared file system "
        "that only you can read";
    if (config_.rank == 0 && config_.size > 1) {
      log::warn("{}", kNoSecret);
    } else {
      log::info("{}", kNoSecret);
    }
  }

  if (!config_.invitation.empty()) {
    join_growth();  // a newcomer: rank, size and store come from the growth (comm/grow.cpp)
    report_on(this);
    return;
  }

  if (config_.pmix_rendezvous) {
    start_through_pmix();
  } else {
    config_.store_generation = next_store_generation(config_.addr, config_.rank);
    const net::Endpoint store_endpoint = net::parse_endpoint(config_.addr, "KOLO_ADDR");
    if (config_.rank == 0) {
      // A host name may resolve to loopback on rank 0's own host (127.0.1.1 on Debian) and to a
      // network address elsewhere: the store then listens on every interface at that port.
      net::Endpoint listen_endpoint = store_endpoint;
      if (!net::is_numeric_address(listen_endpoint.host)) listen_endpoint.host.clear();
      if (net::Socket inherited = inherited_store_socket(config_, store_endpoint);
          inherited.valid()) {
        server_ = std::make_unique<StoreServer>(std::move(inherited), config_.secret,
                                                store_limits(config_));
        log::info(
            "serving the rendezvous store at {} on the socket its launcher bound "
            "(KOLO_STORE_FD)",
            server_->endpoint().to_string());
      } else {
        server_ =
            std::make_unique<StoreServer>(listen_endpoint, config_.secret, store_limits(config_));
        log::info("serving the rendezvous store at {}", server_->endpoint().to_string());
      }
      // A world of one asks for any free port: the store's clients connect where it landed.
      if (store_endpoint.port == 0) config_.addr = server_->endpoint().to_string();
    }
    store_ = open_store(config_);
    start_through_store();
  }
  const std::string allreduce_choice = place_allreduce();

  // Rank 0 serves the store, and it must stay until every rank is done with it: that is so once
  // rank 0 is connected, as each peer authenticates rank 0's connections (net/auth.hpp) only
  // after its GET_MANY was answered, and asks nothing more of the store at start-up. (Under PMIx
  // no rank used it at start-up.)
  // bench/startup_perf.sh reads the time and the number of requests from this line.
  log::info("communicator ready: rank {} of {}, local rank {} of {}, {} node(s), transport {}; "
            "start-up took {:.4f} s and {} store request(s)",
            config_.rank, config_.size, config_.local_rank, config_.local_size, node_count_,
            transport_->name(), std::chrono::duration<double>(Clock::now() - started).count(),
            store_->requests());
  if (config_.rank == 0) {
    // One line per job that says what ran, for bug reports and for comparing runs (rank 0 only).
    log::info("kolo {} (commit {}): {} rank(s) on {} node(s), transport {}, allreduce {} "
              "(KOLO_ALLREDUCE={}; flat: recursive doubling up to {} bytes, ring above), "
              "segments of {} bytes, KOLO_SHM={}, {} TCP stream(s), started by {}, rendezvous "
              "{}",
              build_version(), build_commit(), config_.size, node_count_, transport_->name(),
              allreduce_choice, config_.allreduce,
              kRecursiveDoublingMaxBytesPerRank * static_cast<uint64_t>(config_.size),
              config_.segment_bytes, config_.shm, config_.tcp_streams,
              config_.launcher.empty() ? "config" : config_.launcher,
              config_.pmix_rendezvous ? "through PMIx" : "at " + config_.addr);
  }
  report_on(this);
}

Communicator::~Communicator() {
  stop_reporting_on(this);
  // The engine goes first: its thread may still use the store and server this one holds.
  if (fusion_) fusion_->shutdown();
}

fusion::FusionEngine& Communicator::fusion() {
  std::lock_guard<std::mutex> lock(fusion_mutex_);
  if (!fusion_) {
    // Its connections are told apart from this communicator's by the top bit of the context.
    // It connects from its own thread, through a store connection of its own.
    const uint64_t context = context_ ^ (uint64_t{1} << 63);
    auto connect = [config = config_, context] {
      std::unique_ptr<StoreClient> store = open_store(config);
      return connect_links(config, *store, context, Waiter::kFusionEngine);
    };
    fusion_ = std::make_shared<fusion::FusionEngine>(config_, std::move(connect));
    if (fusion_failure_) fusion_->communicator_failed(*fusion_failure_);
  }
  return *fusion_;
}

// Every rank publishes its KOLO_ALLREDUCE and host identity; ranks on the same host are numbered
// in rank order. The launcher's local rank and size win where it gave them. KOLO_ALLREDUCE must
// agree because the allreduce schedule follows from it: ranks that ran different schedules would
// wait for messages that never come. Every rank reads every value, so every rank finds the same
// disagreement; rank 0, whose process serves the store, waits until every rank has read before it
// fails, so that each reports the disagreement itself.
std::vector<std::string> Communicator::gather_records(const std::string& mine) {
  // Every other rank's record in one request (get_all): a rank whose key never comes never
  // started, or started with another KOLO_ADDR or KOLO_SIZE, and the timeout says so rather than
  // naming a store key.
  store_->set_string(store_key(kWorldContext, "host", config_.rank), mine);
  std::vector<std::string> keys;
  std::vector<int> key_ranks;
  for (int rank = 0; rank < config_.size; ++rank) {
    if (rank == config_.rank) continue;
    keys.push_back(store_key(kWorldContext, "host", rank));
    key_ranks.push_back(rank);
  }
  std::vector<size_t> missing;
  std::vector<std::string> published;
  try {
    published = store_->get_all_strings(keys, &missing);
  } catch (const Error& error) {
    if (missing.empty() ||
        (error.status() != Status::kTimeout && error.status() != Status::kPeerLost)) {
      throw;
    }
    // "rank 3", or "ranks 3, 5, 6, 7 and 2 more": those still missing at the store's last answer.
    std::vector<int> absent;
    for (size_t index : missing) absent.push_back(key_ranks[index]);
    constexpr size_t kShown = 4;
    std::string who = fmt::format(
        "{} {}", absent.size() == 1 ? "rank" : "ranks",
        fmt::join(absent.begin(), absent.begin() + std::min(absent.size(), kShown), ", "));
    if (absent.size() > kShown) who += fmt::format(" and {} more", absent.size() - kShown);
    const char* it = absent.size() == 1 ? "it" : "them";
    // Rank 0 times out first (it started first) and its store goes with it: the other ranks
    // that waited then see the store close.
    if (error.status() == Status::kPeerLost && config_.rank != 0) {
      throw Error(Status::kPeerLost,
                  fmt::format("kolo: {} of {} had not joined when the rendezvous store at {} "
                              "closed (rank {} waited for {}; rank 0, which serves the store, "
                              "gave up waiting for {} or was lost) [{}]",
                              who, config_.size, config_.addr, config_.rank, it, it,
                              error.what()));
    }
    if (error.status() != Status::kTimeout) throw;
    throw Error(Status::kTimeout,
                fmt::format("kolo: {} of {} never joined: rank {} waited {:g} s (KOLO_TIMEOUT) "
                            "for {} at the rendezvous store at {}; was {} started, with the same "
                            "KOLO_ADDR and KOLO_SIZE={}?",
                            who, config_.size, config_.rank, config_.timeout_s, it, config_.addr,
                            it, config_.size));
  }
  published.insert(published.begin() + config_.rank, mine);
  return published;
}

void Communicator::refuse_modes(const std::vector<std::string>& modes, const HostFacts& facts) {
  if (facts.differs < 0) return;
  store_->set_string(store_key(kWorldContext, "host-checked", config_.rank), "1");
  if (config_.rank == 0) {
    std::vector<std::string> checked;
    for (int rank = 0; rank < config_.size; ++rank)
      checked.push_back(store_key(kWorldContext, "host-checked", rank));
    store_->wait(checked);
  }
  throw modes_differ(modes, facts.differs);
}

void Communicator::take_host_facts(const HostFacts& facts) {
  host_of_ = facts.host_of;
  node_count_ = facts.nodes;
  if (config_.local_rank < 0) config_.local_rank = facts.local_rank;
  if (config_.local_size < 0) config_.local_size = facts.local_size;
}

// Through the store in one exchange: this rank's transport and lifeline listen first, on
// KOLO_SOCKET_IFNAME's address or the one this host sends from to reach the store (KOLO_ADDR),
// then one record per rank, one line each field, goes to the store in one SET:
//   KOLO_ALLREDUCE
//   host identity (core/host.hpp)
//   the transport's listening address
//   the lifeline's listening address
//   what KOLO_TRANSPORT=auto decides from (transport_auto_facts)
// and comes back with every other rank's in one GET_MANY; every rank connects from what it read.
// Where KOLO_ADDR names rank 0's host by a name that resolves to loopback here (Debian maps its
// own name to 127.0.1.1), ranks on other hosts may still reach it over the network, unless the
// launcher says that every rank is on this host (local size = size): this rank is then on the
// store's host and listens on the host's only network interface; on a host with several, it
// listens on every interface and publishes its loopback address, which a rank on another host
// reads as "where I reach the store", and its own host for a later store (kolo_comm_shrink, grow)
// and later meshes is the one it routes to the first peer with a network address from
// (listen_host_from_routes). Splits, the fusion engine and GPU set-up keep
// their own exchanges.
void Communicator::start_through_store() {
  const TransportSettings settings = transport_settings(config_);
  const std::string store_host = net::parse_endpoint(config_.addr, "KOLO_ADDR").host;
  const std::string route = settings.socket_ifname.empty() ? store_route(settings) : "";
  std::string host = !settings.socket_ifname.empty()
                         ? net::interface_address(settings.socket_ifname)
                         : route;
  bool everywhere = false;
  if (settings.socket_ifname.empty() && net::is_loopback_address(route) &&
      !net::is_numeric_address(store_host) && store_host != "localhost" &&
      config_.local_size != config_.size) {
    const std::string interface = only_network_interface();
    if (!interface.empty()) {
      host = net::interface_address("=" + interface);
    } else {
      everywhere = true;
    }
  }
  auto prepared = std::make_shared<PreparedMesh>();
  prepared->listener = net::listen_on({everywhere ? std::string() : host, 0});
  net::Socket lifeline_listener = net::listen_on({everywhere ? std::string() : host, 0});
  const std::string mine = join_record(
      {config_.allreduce, host_identity(config_),
       net::Endpoint{host, net::local_endpoint(prepared->listener).port}.to_string(),
       net::Endpoint{host, net::local_endpoint(lifeline_listener).port}.to_string(),
       transport_auto_facts(settings)},
      config_.rank);
  StartupRecords read =
      read_startup_records(gather_records(mine), false, config_, "at the rendezvous store");
  prepared->addresses = std::move(read.addresses);
  prepared->auto_facts = std::move(read.auto_facts);
  const HostFacts facts = read_host_facts(read.modes, read.identities, config_.rank);
  refuse_modes(read.modes, facts);
  take_host_facts(facts);
  // A loopback address of a rank on another host: that rank is on the store's host and listens on
  // every interface there.
  std::string store_address;
  std::vector<std::pair<int, std::string>> routes;
  for (int rank = 0; rank < config_.size; ++rank) {
    if (rank == config_.rank) continue;
    for (std::string* address : {&prepared->addresses[static_cast<size_t>(rank)],
                                 &read.lifelines[static_cast<size_t>(rank)]}) {
      net::Endpoint endpoint = net::parse_endpoint(
          *address, fmt::format("the address published by rank {}", rank));
      if (address == &prepared->addresses[static_cast<size_t>(rank)]) {
        routes.emplace_back(rank, endpoint.host);
      }
      if (read.identities[static_cast<size_t>(rank)] ==
              read.identities[static_cast<size_t>(config_.rank)] ||
          !net::is_numeric_address(endpoint.host) || !net::is_loopback_address(endpoint.host)) {
        continue;
      }
      if (store_address.empty()) store_address = numeric_address(store_host);
      *address = net::Endpoint{store_address, endpoint.port}.to_string();
    }
  }
  if (everywhere) host = listen_host_from_routes(settings, route, routes);
  connect_world(host, prepared, std::move(lifeline_listener), read.lifelines, host);
}

// Under PMIx (bootstrap/pmix.hpp): this rank's transport and lifeline listen first, on
// KOLO_SOCKET_IFNAME's address or the one its host routes to the other hosts from (pmix::
// route_target: rank 0's host, or from rank 0's host the first other host; on a multi-homed host
// that is the interface the host names of the job resolve through, as for the store's address
// under other launchers). Then one record per rank, one line each field, goes through one fence:
//   KOLO_ALLREDUCE
//   host identity (core/host.hpp)
//   the transport's listening address
//   the lifeline's listening address
//   what KOLO_TRANSPORT=auto decides from (transport_auto_facts)
//   the store's address (rank 0: the port it reserved; "" on the other ranks)
// and every rank connects from what it read (UCX sends its worker addresses over its control
// connections). No store request is made: world rank 0 serves the store from its first use.
void Communicator::start_through_pmix() {
  config_.store_generation = next_store_generation("PMIx", config_.rank);
  const std::string host =
      !config_.socket_ifname.empty()
          ? net::interface_address(config_.socket_ifname)
          : net::route_source_address({pmix::route_target(config_), 0},
                                      "the host PMIx names for rank 0 or a peer (PMIX_HOSTNAME)");
  auto prepared = std::make_shared<PreparedMesh>();
  prepared->listener = net::listen_on({host, 0});
  net::Socket lifeline_listener = net::listen_on({host, 0});
  std::string store_address;
  if (config_.rank == 0) {
    reserved_store_ = reserve_store(config_);
    const std::string store_host = !config_.socket_ifname.empty()
                                       ? net::interface_address(config_.socket_ifname)
                                       : net::host_name();
    store_address = net::Endpoint{store_host, reserved_store_->port()}.to_string();
  }
  const TransportSettings settings = transport_settings(config_);
  const std::vector<std::string> mine_fields = {config_.allreduce,
                                                host_identity(config_),
                                                net::local_endpoint(prepared->listener).to_string(),
                                                net::local_endpoint(lifeline_listener).to_string(),
                                                transport_auto_facts(settings),
                                                store_address};
  const std::string mine = join_record(mine_fields, config_.rank);
  StartupRecords read =
      read_startup_records(pmix::exchange(config_, mine), true, config_, "through PMIx");
  prepared->addresses = std::move(read.addresses);
  prepared->auto_facts = std::move(read.auto_facts);
  config_.addr = read.store_address;
  const HostFacts facts = read_host_facts(read.modes, read.identities, config_.rank);
  // Every rank read every record, so every rank finds the same disagreement.
  if (facts.differs >= 0) throw modes_differ(read.modes, facts.differs);
  take_host_facts(facts);
  log::info(
      "start-up records of {} ranks from PMIx; the rendezvous store will be at {} once a "
      "split, the fusion engine or GPU set-up needs it",
      config_.size, config_.addr);
  store_ = open_store(config_);  // connects at its first request, if any
  connect_world(host, prepared, std::move(lifeline_listener), read.lifelines, {});
}

void Communicator::connect_world(const std::string& host,
                                 const std::shared_ptr<PreparedMesh>& prepared,
                                 net::Socket lifeline_listener,
                                 const std::vector<std::string>& lifelines,
                                 const std::string& lifeline_host) {
  if (config_.bind != "none") {
    log::info("{}", bind_process(config_.bind, config_.local_rank));
  }
  Links links =
      connect_links(config_, *store_, kWorldContext, Waiter::kApplication, host, prepared);
  transport_ = std::move(links.transport);
  ring_ = std::move(links.ring);
  lifeline_ = std::make_shared<Lifeline>(config_, kWorldContext, std::move(lifeline_listener),
                                         lifelines, lifeline_host);
}

std::string Communicator::place_allreduce() {
  const AllreduceMode mode = config_.allreduce == "ring"           ? AllreduceMode::kRing
                             : config_.allreduce == "hierarchical" ? AllreduceMode::kHierarchical
                                                                   : AllreduceMode::kAuto;
  HostMap hosts(host_of_);
  const HostShape& shape = hosts.shape();
  // What allreduce_algorithm() gives below and above recursive doubling's size limit.
  const uint64_t limit = kRecursiveDoublingMaxBytesPerRank * static_cast<uint64_t>(size());
  std::string choice = "flat";
  if (mode != AllreduceMode::kRing) {
    const Algorithm small = allreduce_algorithm(limit, size(), mode, shape);
    const Algorithm large = allreduce_algorithm(limit + 1, size(), mode, shape);
    if (small != Algorithm::kRecursiveDoubling || large != Algorithm::kRing) {
      auto name = [](Algorithm algorithm) {
        return algorithm == Algorithm::kRecursiveDoubling || algorithm == Algorithm::kRing
                   ? "flat"
                   : algorithm_name(algorithm);
      };
      choice = small == large
                   ? name(small)
                   : fmt::format("{} up to {} bytes, {} above", name(small), limit, name(large));
    }
  }
  log::info(
      "allreduce: KOLO_ALLREDUCE={}: {}; {} hosts (leaders {}), at most {} ranks on one; "
      "steps between hosts of a small allreduce: {} hierarchical, {} recursive doubling",
      config_.allreduce, choice, shape.hosts, fmt::join(hosts.leaders(), ","), shape.largest_host,
      shape.hierarchical_network_steps, shape.flat_network_steps);
  ring_->set_allreduce_placement(mode, std::move(hosts));
  return choice;
}

template <typename Body>
void Communicator::run(OpDescriptor op, Body&& body, bool numbered) {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  const bool contended = !lock.owns_lock();
  if (contended) lock.lock();
  if (broken_) throw *broken_;
  if (numbered) op.sequence = ++sequence_;
  // Ordered calls are matched between ranks by their sequence numbers, taken here in the order
  // threads reach the lock; two threads that race for it may take them in another order on
  // another rank. Nothing on this rank can tell whether the application ordered them, so the
  // race itself is reported, once.
  if (contended && numbered && !warned_concurrent_) {
    warned_concurrent_ = true;
    log::warn(
        "rank {}: {} waited for another thread's collective on the same communicator; "
        "collectives from several threads are numbered in the order they reach it, which "
        "may differ from rank to rank unless the application orders them: differing calls "
        "then fail with KOLO_ERR_MISMATCH, and calls of one shape may swap results. Give "
        "each thread a communicator of its own (kolo_comm_split) or use named operations",
        config_.rank, describe(op));
  }
  start_activity(op);
  try {
    body(op);
    end_activity(false);
  } catch (const Error& error) {
    if (error.status() == Status::kTimeout) log::warn("at the timeout: {}", report());
    end_activity(true);
    broken_.emplace(error);
    transport_->abort(error);  // even after a PeerLeft: this collective is abandoned
    tell_fusion_engine(*broken_);
    throw;
  } catch (const std::exception& error) {
    end_activity(true);
    broken_.emplace(Status::kInternal, fmt::format("{} failed: {}", describe(op), error.what()));
    transport_->abort(*broken_);
    tell_fusion_engine(*broken_);
    throw *broken_;
  }
}

void Communicator::start_activity(const OpDescriptor& op) {
  std::lock_guard<std::mutex> lock(activity_mutex_);
  activity_.op = op;
  activity_.started = CoarseClock::now();
  activity_.running.store(true, std::memory_order_relaxed);
}

void Communicator::end_activity(bool failed) {
  if (failed) activity_.failed.store(true, std::memory_order_relaxed);
  activity_.running.store(false, std::memory_order_relaxed);
}

std::string Communicator::report() {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(activity_mutex_);
    const bool running = activity_.running.load(std::memory_order_relaxed);
    const bool failed = activity_.failed.load(std::memory_order_relaxed);
    const double seconds =
        std::chrono::duration<double>(CoarseClock::now() - activity_.started).count();
    text = fmt::format("rank {} of {} (communicator {:x}): ", config_.rank, config_.size, context_);
    if (!activity_.op) {
      text += "no collective yet";
    } else if (running) {
      const int peer = ring_ ? ring_->waiting_for() : -1;
      text += fmt::format("in {} for {:.1f} s{}", describe(*activity_.op), seconds,
                          peer >= 0 ? fmt::format(", waiting for rank {}", peer) : "");
    } else {
      text += fmt::format("{}; the last collective, {}, started {:.1f} s ago and ended",
                          failed ? "broken" : "idle", describe(*activity_.op), seconds);
    }
  }
  std::shared_ptr<fusion::FusionEngine> engine;
  {
    std::lock_guard<std::mutex> lock(fusion_mutex_);
    engine = fusion_;
  }
  if (engine) text += "; " + engine->report();
  return text;
}

void Communicator::tell_fusion_engine(const Error& error) {
  std::lock_guard<std::mutex> lock(fusion_mutex_);
  if (fusion_failure_) return;
  fusion_failure_.emplace(error);
  if (fusion_) fusion_->communicator_failed(error);
}

void Communicator::run_collective(const OpDescriptor& op,
                                  const std::function<void(const OpDescriptor&)>& body) {
  run(op, body);
}

void Communicator::run_point_to_point(const OpDescriptor& op,
                                      const std::function<void(const OpDescriptor&)>& body) {
  run(op, body, false);
}

void Communicator::allreduce(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype,
                             ReduceOp op, double prescale, double postscale,
                             const gpu::Stream* stream) {
  arguments::check_dtype(dtype, "allreduce");
  arguments::check_op(op, "allreduce");
  arguments::check_scale_factors(prescale, postscale, "allreduce");
  arguments::check_buffer(sendbuf, count, dtype, "allreduce: sendbuf", rank());
  arguments::check_buffer(recvbuf, count, dtype, "allreduce: recvbuf", rank());
  if (arguments::partially_overlap(sendbuf, recvbuf, count * dtype_size(dtype))) {
    throw arguments::invalid("allreduce",
                             "sendbuf and recvbuf overlap without being the same "
                             "buffer");
  }
  OpDescriptor descriptor;
  descriptor.collective = Collective::kAllreduce;
  descriptor.dtype = dtype;
  descriptor.op = op;
  descriptor.count = count;
  descriptor.prescale = prescale;
  descriptor.postscale = postscale;
  if (stream || gpu::is_device_memory(sendbuf) ||
      (recvbuf != sendbuf && gpu::is_device_memory(recvbuf))) {
    return gpu_allreduce(descriptor, sendbuf, recvbuf, stream);
  }
  run(descriptor, [&](const OpDescriptor& d) { run_allreduce(*ring_, d, sendbuf, recvbuf); });
}

void Communicator::broadcast(void* buffer, uint64_t count, DataType dtype, int root,
                             const gpu::Stream* stream) {
  arguments::check_dtype(dtype, "broadcast");
  arguments::check_root(root, size(), "broadcast");
  arguments::check_buffer(buffer, count, dtype, "broadcast: buf", rank());
  OpDescriptor descriptor;
  descriptor.collective = Collective::kBroadcast;
  descriptor.dtype = dtype;
  descriptor.count = count;
  descriptor.root = root;
  if (stream || gpu::is_device_memory(buffer)) return gpu_broadcast(descriptor, buffer, stream);
  run(descriptor, [&](const OpDescriptor& d) { ring_broadcast(*ring_, d, buffer); });
}

void Communicator::barrier() {
  OpDescriptor descriptor;
  descriptor.collective = Collective::kBarrier;
  run(descriptor, [&](const OpDescriptor& d) { ring_barrier(*ring_, d); });
}

}  // namespace kolo
