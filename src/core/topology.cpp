#include "core/topology.hpp"

#include <fmt/format.h>
#include <hwloc.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "kolo/status.hpp"

namespace kolo {
namespace {

// hwloc's view of this machine, loaded once and kept for the life of the process: binding needs
// the topology object too. Only the cores this process may use (its cgroup or Slurm allocation)
// are in it, since hwloc 2 drops disallowed resources by default.
struct Machine {
  hwloc_topology_t topology = nullptr;  // nullptr when hwloc could not load it
  Topology summary;
  // The NUMA nodes that binding may use, in logical order (see numa_domains()).
  std::vector<hwloc_obj_t> numa_domains;
};

// NUMA nodes without CPUs of their own (high-bandwidth or CXL memory) share their CPU set with
// another node or span the whole machine; binding a rank to them would place nothing. So ranks
// are spread over the distinct, non-empty CPU sets of NUMA nodes, ignoring a machine-wide one
// when narrower ones exist.
std::vector<hwloc_obj_t> numa_domains(hwloc_topology_t topology) {
  std::vector<hwloc_obj_t> domains;
  int nodes = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < nodes; ++i) {
    hwloc_obj_t node =
        hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    if (node == nullptr || node->cpuset == nullptr || hwloc_bitmap_iszero(node->cpuset)) continue;
    bool seen = false;
    for (hwloc_obj_t domain : domains)
      seen = seen || hwloc_bitmap_isequal(domain->cpuset, node->cpuset);
    if (!seen) domains.push_back(node);
  }
  hwloc_const_cpuset_t whole = hwloc_topology_get_topology_cpuset(topology);
  if (domains.size() > 1) {
    std::erase_if(domains,
                  [&](hwloc_obj_t node) { return hwloc_bitmap_isequal(node->cpuset, whole); });
  }
  return domains;
}

const Machine& machine() {
  static const Machine loaded = [] {
    Machine result;
    hwloc_topology_t topology = nullptr;
    if (hwloc_topology_init(&topology) != 0) return result;
    if (hwloc_topology_load(topology) != 0) {
      hwloc_topology_destroy(topology);
      return result;
    }
    result.topology = topology;
    int pus = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_PU);
    int cores = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_CORE);
    result.numa_domains = numa_domains(topology);
    result.summary.pus = pus > 0 ? pus : 1;
    // Some platforms report no cores; each hardware thread then counts as one.
    result.summary.cores = cores > 0 ? cores : result.summary.pus;
    result.summary.numa_nodes =
        result.numa_domains.empty() ? 1 : static_cast<int>(result.numa_domains.size());
    return result;
  }();
  return loaded;
}

std::string cpu_list(hwloc_const_cpuset_t set) {
  char* text = nullptr;
  if (hwloc_bitmap_list_asprintf(&text, set) < 0 || text == nullptr) return "?";
  std::string list(text);
  std::free(text);
  return list;
}

void bind_to(const Machine& m, hwloc_const_cpuset_t set, const std::string& what) {
  if (hwloc_set_cpubind(m.topology, set, HWLOC_CPUBIND_PROCESS) != 0) {
    int error = errno;
    throw Error(Status::kSystem, fmt::format("kolo: cannot bind this process to {} (PUs {}): {}",
                                             what, cpu_list(set), std::strerror(error)));
  }
}

}  // namespace

const Topology& local_topology() {
  return machine().summary;
}

std::string bind_process(const std::string& policy, int local_rank) {
  if (policy == "none") return "not bound (KOLO_BIND=none)";
  if (policy != "core" && policy != "numa") {
    throw Error(Status::kConfig,
                fmt::format("kolo: KOLO_BIND={} is not a binding policy: expected none, core or "
                            "numa",
                            policy));
  }
  if (local_rank < 0) {
    throw Error(Status::kInvalidArgument,
                fmt::format("kolo: cannot bind to a {} without knowing the local rank (got {})",
                            policy, local_rank));
  }
  const Machine& m = machine();
  if (m.topology == nullptr) {
    throw Error(
        Status::kSystem,
        fmt::format("kolo: KOLO_BIND={}: hwloc could not read this machine's topology", policy));
  }

  if (policy == "core") {
    hwloc_obj_type_t type =
        hwloc_get_nbobjs_by_type(m.topology, HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
    unsigned index = static_cast<unsigned>(local_rank % m.summary.cores);
    hwloc_obj_t core = hwloc_get_obj_by_type(m.topology, type, index);
    if (core == nullptr || core->cpuset == nullptr) {
      throw Error(Status::kSystem, fmt::format("kolo: hwloc lists no core {}", index));
    }
    std::string what = fmt::format("core {}", index);
    bind_to(m, core->cpuset, what);
    return fmt::format("bound to {} (PUs {})", what, cpu_list(core->cpuset));
  }

  if (m.numa_domains.empty()) {
    throw Error(Status::kSystem, "kolo: KOLO_BIND=numa: hwloc lists no NUMA node with CPUs");
  }
  // Named by the operating system's number, as numactl and /sys/devices/system/node show it.
  hwloc_obj_t node = m.numa_domains[static_cast<size_t>(local_rank) % m.numa_domains.size()];
  std::string what = fmt::format("NUMA node {}", node->os_index);
  bind_to(m, node->cpuset, what);
  return fmt::format("bound to {} (PUs {})", what, cpu_list(node->cpuset));
}

}  // namespace kolo
