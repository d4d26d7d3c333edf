// The local machine's topology through hwloc: cores and NUMA nodes, and placing this rank.
#pragma once

#include <string>

namespace kolo {

struct Topology {
  int cores = 1;       // physical cores
  int numa_nodes = 1;  // NUMA nodes with distinct CPUs (memory-only nodes are not counted)
  int pus = 1;         // hardware threads
};

// Reads the topology with hwloc (cached after the first call).
const Topology& local_topology();

// Binds the calling process according to policy ("none", "core", "numa") for the given local
// rank: core binds to core (local_rank mod cores), numa to NUMA node (local_rank mod nodes).
// Returns a one-line description of what was done, for the INFO log, such as "bound to core 1
// (PUs 1,17)". Throws kolo::Error(kConfig) for an unknown policy, kolo::Error(kInvalidArgument)
// for local_rank < 0 with core or numa, and kolo::Error(kSystem) if hwloc cannot bind. Binds
// every thread of the process, and the threads it starts later inherit the binding.
std::string bind_process(const std::string& policy, int local_rank);

}  // namespace kolo
