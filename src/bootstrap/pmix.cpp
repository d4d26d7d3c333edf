// The PMIx exchange of the ranks' start-up records (bootstrap/pmix.hpp says when and why).
#include "bootstrap/pmix.hpp"

#include <fmt/format.h>
#include <pmix.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "core/log.hpp"
#include "kolo/status.hpp"

namespace kolo::pmix {
namespace {

constexpr const char* kUseStoreInstead =
    "set KOLO_ADDR=host:port (rank 0's host and a free port) to rendezvous without PMIx";

std::string error_name(pmix_status_t status) {
  const char* name = PMIx_Error_string(status);
  return name ? name : fmt::format("PMIx status {}", status);
}

// This process as PMIx knows it, after the one PMIx_Init of the process; PMIx_Finalize runs at
// exit. A failed PMIx_Init is reported to every caller, never retried.
struct Client {
  pmix_status_t init_status = PMIX_ERR_INIT;
  pmix_proc_t self{};
  double init_ms = 0;  // how long PMIx_Init took
};

// Whether a start-up has logged PMIx_Init's time yet: the first one does (its start-up paid for
// it), later ones log 0.
std::atomic<bool> g_init_logged{false};

// The process that called PMIx_Init; a child forked from it (a data loader's worker) that exits
// through exit() must not finalize the parent's connection.
pid_t g_initialized_in = 0;

void finalize_at_exit() {
  if (::getpid() == g_initialized_in) PMIx_Finalize(nullptr, 0);
}

const Client& client() {
  static const Client instance = [] {
    Client made;
    const auto started = std::chrono::steady_clock::now();
    made.init_status = PMIx_Init(&made.self, nullptr, 0);
    made.init_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                             started)
                       .count();
    if (made.init_status == PMIX_SUCCESS) {
      g_initialized_in = ::getpid();
      std::atexit(finalize_at_exit);
      log::info("PMIx client of namespace {}, rank {} (PMIx {})", made.self.nspace, made.self.rank,
                PMIx_Get_version());
    }
    return made;
  }();
  return instance;
}

// A fence in flight. PMIx calls back from its own thread, possibly after the waiter gave up at
// its deadline: the callback owns one reference, so the state outlives whichever ends last.
struct Fence {
  std::mutex mutex;
  std::condition_variable done_changed;
  bool done = false;
  pmix_status_t status = PMIX_SUCCESS;
  pmix_info_t info[2];
};

void fence_done(pmix_status_t status, void* data) {
  auto* owner = static_cast<std::shared_ptr<Fence>*>(data);
  {
    std::lock_guard<std::mutex> lock((*owner)->mutex);
    (*owner)->done = true;
    (*owner)->status = status;
  }
  (*owner)->done_changed.notify_all();
  delete owner;
}

// PMIx_Fence over the whole namespace with data collection, bounded by the configured timeout:
// PMIX_TIMEOUT asks the server to give up in time, and this rank stops waiting at its own deadline
// whether or not the server does.
void fence(const Config& config) {
  auto state = std::make_shared<Fence>();
  bool collect = true;
  // PMIX_TIMEOUT is in whole seconds, and 0 would mean none.
  int seconds = static_cast<int>(std::min(std::ceil(config.timeout_s), 1e6));
  if (seconds < 1) seconds = 1;
  PMIX_INFO_LOAD(&state->info[0], PMIX_COLLECT_DATA, &collect, PMIX_BOOL);
  PMIX_INFO_LOAD(&state->info[1], PMIX_TIMEOUT, &seconds, PMIX_INT);
  auto* owner = new std::shared_ptr<Fence>(state);
  pmix_status_t started = PMIx_Fence_nb(nullptr, 0, state->info, 2, fence_done, owner);
  if (started == PMIX_OPERATION_SUCCEEDED) {
    delete owner;
    return;
  }
  if (started != PMIX_SUCCESS) {
    delete owner;
    throw Error(Status::kConfig,
                fmt::format("kolo: rank {} of {}: PMIx_Fence failed ({}); {}", config.rank,
                            config.size, error_name(started), kUseStoreInstead));
  }
  std::unique_lock<std::mutex> lock(state->mutex);
  const auto limit = std::chrono::duration<double>(config.timeout_s);
  if (!state->done_changed.wait_for(lock, limit, [&] { return state->done; }) ||
      state->status == PMIX_ERR_TIMEOUT) {
    throw Error(
        Status::kTimeout,
        fmt::format("kolo: rank {} of {}: the PMIx fence that exchanges the ranks' "
                    "start-up records did not complete within {:g} s (KOLO_TIMEOUT): some rank of "
                    "the job has not reached kolo_comm_init, or made fewer communicators "
                    "than this one; {}",
                    config.rank, config.size, config.timeout_s, kUseStoreInstead));
  }
  if (state->status != PMIX_SUCCESS) {
    throw Error(Status::kPeerLost,
                fmt::format("kolo: rank {} of {}: the PMIx fence that exchanges the ranks' "
                            "start-up records failed ({}): a rank of the job may have ended; {}",
                            config.rank, config.size, error_name(state->status), kUseStoreInstead));
  }
}

}  // namespace

bool built_with_pmix() {
  return true;
}

namespace {

// The client, checked against kolo's own idea of this process; throws what pmix.hpp says.
const Client& checked_client(const Config& config) {
  const Client& me = client();
  if (me.init_status != PMIX_SUCCESS) {
    throw Error(
        Status::kConfig,
        fmt::format("kolo: rank {} of {}: PMIx_Init failed ({}) although PMIX_NAMESPACE "
                    "and PMIX_RANK say a PMIx server started this process; {}",
                    config.rank, config.size, error_name(me.init_status), kUseStoreInstead));
  }
  if (static_cast<int64_t>(me.self.rank) != config.rank) {
    throw Error(
        Status::kConfig,
        fmt::format("kolo: PMIx says this process is rank {} of namespace {}, but its "
                    "kolo rank is {} (from {}): PMIx ranks must be kolo's ranks for the "
                    "rendezvous through PMIx; {}",
                    me.self.rank, me.self.nspace, config.rank, config.launcher, kUseStoreInstead));
  }
  return me;
}

// A string PMIx holds for `rank` of this namespace (PMIX_RANK_WILDCARD: the job's), or "" where
// it has none. Only what PMIx holds here already: nothing is asked of other hosts.
std::string get_string(const Client& me, pmix_rank_t rank, const char* key) {
  pmix_proc_t proc;
  PMIX_PROC_LOAD(&proc, me.self.nspace, rank);
  pmix_info_t optional;
  bool here_only = true;
  PMIX_INFO_LOAD(&optional, PMIX_OPTIONAL, &here_only, PMIX_BOOL);
  pmix_value_t* value = nullptr;
  const pmix_status_t got = PMIx_Get(&proc, key, &optional, 1, &value);
  PMIX_INFO_DESTRUCT(&optional);
  std::string text;
  if (got == PMIX_SUCCESS && value && value->type == PMIX_STRING && value->data.string) {
    text = value->data.string;
  }
  if (value) PMIX_VALUE_RELEASE(value);
  return text;
}

}  // namespace

std::vector<std::string> exchange(const Config& config, const std::string& record) {
  using Clock = std::chrono::steady_clock;
  auto milliseconds = [](Clock::time_point since) {
    return std::chrono::duration<double, std::milli>(Clock::now() - since).count();
  };
  const Client& me = checked_client(config);
  // PMIx_Init ran at this process's first PMIx call (here, or route_target before the listeners):
  // the first start-up counts it, as it paid for it.
  const double init_ms = g_init_logged.exchange(true) ? 0.0 : me.init_ms;
  const auto started = Clock::now();
  const std::string key = fmt::format("kolo.{}", config.store_generation);
  pmix_value_t value;
  PMIX_VALUE_CONSTRUCT(&value);
  value.type = PMIX_STRING;
  value.data.string = const_cast<char*>(record.c_str());
  pmix_status_t put = PMIx_Put(PMIX_GLOBAL, key.c_str(), &value);
  if (put == PMIX_SUCCESS) put = PMIx_Commit();
  if (put != PMIX_SUCCESS) {
    throw Error(Status::kConfig,
                fmt::format("kolo: rank {} of {}: PMIx_Put or PMIx_Commit of {} failed ({}); {}",
                            config.rank, config.size, key, error_name(put), kUseStoreInstead));
  }
  const auto fence_started = Clock::now();
  fence(config);
  const double fence_ms = milliseconds(fence_started);
  std::vector<std::string> records(static_cast<size_t>(config.size));
  for (int rank = 0; rank < config.size; ++rank) {
    if (rank == config.rank) {
      records[static_cast<size_t>(rank)] = record;
      continue;
    }
    // The fence collected the data: a record is here or nowhere.
    std::string& got = records[static_cast<size_t>(rank)];
    got = get_string(me, static_cast<pmix_rank_t>(rank), key.c_str());
    if (got.empty()) {
      throw Error(Status::kConfig,
                  fmt::format("kolo: rank {} of {}: after the PMIx fence, rank {} has no record "
                              "{}: it made fewer communicators through PMIx than this rank, or "
                              "is not kolo's rank {}; {}",
                              config.rank, config.size, rank, key, rank, kUseStoreInstead));
    }
  }
  log::info(
      "PMIx: {} start-up records exchanged in {:.1f} ms (PMIx_Init {:.1f} ms, the fence "
      "{:.1f} ms)",
      config.size, init_ms + milliseconds(started), init_ms, fence_ms);
  return records;
}

std::string route_target(const Config& config) {
  const Client& me = checked_client(config);
  const std::string first = get_string(me, 0, PMIX_HOSTNAME);
  const std::string own = get_string(me, me.self.rank, PMIX_HOSTNAME);
  if (first.empty() || own.empty()) {
    throw Error(Status::kConfig,
                fmt::format("kolo: rank {} of {}: the PMIx server names no host (PMIX_HOSTNAME) "
                            "for rank 0 or this rank, so kolo cannot tell which interface its "
                            "peers reach it on: set KOLO_SOCKET_IFNAME to the interface (or its "
                            "address) to listen on",
                            config.rank, config.size));
  }
  if (first != own) return first;
  // On rank 0's host: the first rank on another host, by its host name. PMIX_LOCAL_PEERS lists
  // this host's ranks ("0,1,5"), so that only one other rank's name is asked for.
  std::vector<bool> local(static_cast<size_t>(config.size), false);
  const std::string peers = get_string(me, PMIX_RANK_WILDCARD, PMIX_LOCAL_PEERS);
  for (size_t at = 0; at < peers.size();) {
    const size_t comma = std::min(peers.find(',', at), peers.size());
    const long rank = std::strtol(peers.substr(at, comma - at).c_str(), nullptr, 10);
    if (rank >= 0 && rank < config.size) local[static_cast<size_t>(rank)] = true;
    at = comma + 1;
  }
  for (int rank = 1; rank < config.size; ++rank) {
    if (local[static_cast<size_t>(rank)]) continue;
    const std::string other = get_string(me, static_cast<pmix_rank_t>(rank), PMIX_HOSTNAME);
    if (!other.empty() && other != own) return other;
  }
  return own;
}

}  // namespace kolo::pmix
