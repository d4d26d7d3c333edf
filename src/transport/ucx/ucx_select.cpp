// KOLO_TRANSPORT=auto: which transport a job uses.
//
// UCX wins where it has a path kolo's TCP transport lacks: shared memory when every rank is on one
// host (the copy goes through memory instead of the loopback TCP stack), and RDMA when every host
// has an active InfiniBand/RoCE port. Anywhere else both end up on TCP sockets, and kolo's own
// transport, which needs no extra library state, is kept. The ranks must agree, so rank 0 decides
// from what every rank published and the others read its verdict.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "bootstrap/store.hpp"
#include "net/socket.hpp"
#include "transport/mesh.hpp"
#include "transport/ucx/ucx_transport.hpp"

namespace kolo {

bool has_active_rdma_port() {
  namespace fs = std::filesystem;
  std::error_code error;
  for (const auto& device : fs::directory_iterator("/sys/class/infiniband", error)) {
    for (const auto& port : fs::directory_iterator(device.path() / "ports", error)) {
      std::ifstream state(port.path() / "state");
      std::string text;
      std::getline(state, text);
      if (text.find("ACTIVE") != std::string::npos) return true;
    }
  }
  return false;
}

std::string ucx_auto_facts(const TransportSettings& settings) {
  return fmt::format("{} {}", has_active_rdma_port() ? 1 : 0,
                     settings.host.empty() ? net::host_name() : settings.host);
}

namespace {

// The verdict from every rank's ucx_auto_facts: "ucx <reason>" or "tcp <reason>".
std::string decide(const std::vector<std::string>& facts, int size) {
  std::set<std::string> hosts;
  int without_rdma = 0;
  for (const std::string& published : facts) {
    std::istringstream entry(published);
    int rdma = 0;
    std::string host;
    entry >> rdma;
    std::getline(entry >> std::ws, host);
    hosts.insert(host);
    if (!rdma) ++without_rdma;
  }
  if (hosts.size() == 1)
    return fmt::format("ucx all {} ranks are on one host: shared memory", size);
  if (without_rdma == 0) {
    return fmt::format("ucx every rank of {} hosts has an active RDMA port", hosts.size());
  }
  return fmt::format("tcp {} hosts, and {} of {} ranks have no active RDMA port", hosts.size(),
                     without_rdma, size);
}

}  // namespace

bool ucx_is_faster(const TransportSettings& settings, StoreClient& store, int rank, int size,
                   uint64_t context, std::string& reason) {
  if (size == 1) {
    reason = "a single rank sends nothing";
    return false;
  }
  std::string verdict;
  if (settings.prepared && settings.prepared->auto_facts.size() == static_cast<size_t>(size)) {
    // Every rank holds every rank's facts already, and decides alike.
    verdict = decide(settings.prepared->auto_facts, size);
  } else {
    store.set_string(store_key(context, "transport-auto", rank), ucx_auto_facts(settings));
    if (rank == 0) {
      std::vector<std::string> keys;
      for (int other = 0; other < size; ++other) {
        keys.push_back(store_key(context, "transport-auto", other));
      }
      store.set_string(store_key(context, "transport-auto/verdict"),
                       decide(store.get_all_strings(keys), size));
    }
    verdict = store.get_string(store_key(context, "transport-auto/verdict"));
  }
  size_t space = verdict.find(' ');
  reason = verdict.substr(space + 1);
  return verdict.substr(0, space) == "ucx";
}

}  // namespace kolo
