// The transports kolo knows, and the choice among them (transport/transport.hpp): adding a
// transport is a folder under src/transport/ and one entry here.
#include <fmt/format.h>

#include "core/log.hpp"
#include "kolo_build_config.h"
#include "transport/tcp/tcp_transport.hpp"
#include "transport/transport.hpp"
#ifdef KOLO_HAVE_UCX
#include "transport/ucx/ucx_transport.hpp"
#endif

namespace kolo {

const std::vector<TransportEntry>& transport_registry() {
  static const std::vector<TransportEntry> entries = {
#ifdef KOLO_HAVE_UCX
      {"ucx", make_ucx_transport, ucx_is_faster, nullptr},
#else
      {"ucx", nullptr, nullptr, "kolo was built without UCX (install libucx-dev and rebuild)"},
#endif
      {"tcp", make_tcp_transport, nullptr, nullptr},
  };
  return entries;
}

namespace {

std::string names_built() {
  std::string names;
  for (const TransportEntry& entry : transport_registry()) {
    if (!entry.connect) continue;
    if (!names.empty()) names += ", ";
    names += entry.name;
  }
  return names;
}

// KOLO_TRANSPORT=auto: the first transport whose probe says yes, else the last one built.
const TransportEntry& choose_automatically(const TransportSettings& settings, StoreClient& store,
                                           int rank, int size, uint64_t context) {
  const TransportEntry* fallback = nullptr;
  std::string reasons;
  for (const TransportEntry& entry : transport_registry()) {
    if (!entry.connect) {
      reasons += reasons.empty() ? "" : "; ";
      reasons += entry.missing_reason;
      continue;
    }
    fallback = &entry;
    if (!entry.probe) continue;
    std::string reason;
    if (entry.probe(settings, store, rank, size, context, reason)) {
      log::info("KOLO_TRANSPORT=auto chose {}: {}", entry.name, reason);
      return entry;
    }
    reasons += reasons.empty() ? "" : "; ";
    reasons += reason;
  }
  log::info("KOLO_TRANSPORT=auto chose {}: {}", fallback->name, reasons);
  return *fallback;
}

// KOLO_SHM=auto: kolo's shared-memory rings for the peers on this host wherever kolo picks the
// path, that is under ucx and under KOLO_TRANSPORT=auto; an explicit KOLO_TRANSPORT=tcp means TCP
// sockets to every peer, as it always did.
TransportSettings with_shm_resolved(const TransportSettings& settings) {
  TransportSettings resolved = settings;
  if (resolved.shm == "auto") resolved.shm = settings.transport == "tcp" ? "0" : "1";
  return resolved;
}

}  // namespace

std::string transport_auto_facts(const TransportSettings& settings) {
#ifdef KOLO_HAVE_UCX
  return ucx_auto_facts(settings);
#else
  (void)settings;
  return {};
#endif
}

std::unique_ptr<Transport> make_transport(const TransportSettings& settings, StoreClient& store,
                                          int rank, int size, uint64_t context) {
  if (settings.transport == "auto") {
    const TransportEntry& entry = choose_automatically(settings, store, rank, size, context);
    return entry.connect(with_shm_resolved(settings), store, rank, size, context);
  }
  for (const TransportEntry& entry : transport_registry()) {
    if (settings.transport != entry.name) continue;
    if (!entry.connect) {
      throw Error(Status::kUnsupported,
                  fmt::format("KOLO_TRANSPORT={} is not available: {}; available: {}", entry.name,
                              entry.missing_reason, names_built()));
    }
    return entry.connect(with_shm_resolved(settings), store, rank, size, context);
  }
  std::string names;
  for (const TransportEntry& entry : transport_registry()) names += fmt::format("{}, ", entry.name);
  throw Error(Status::kUnsupported, fmt::format("KOLO_TRANSPORT={} is not a transport ({}or auto)",
                                                settings.transport, names));
}

}  // namespace kolo
