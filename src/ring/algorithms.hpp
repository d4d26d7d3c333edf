// Which schedule a collective uses. The rings are bandwidth-optimal but cost a message latency
// per step, 2(N-1) steps for allreduce and N-1 for allgather; below a size the latency-optimal
// schedules win: recursive doubling for allreduce (log2 N steps, two more when N is not a power
// of two) and Bruck's allgather (ceil(log2 N) steps). The switch points were measured with
// bench/all_reduce_perf and bench/all_gather_perf at N = 2..5 on one machine; docs/tuning.md's
// "Choosing the allreduce schedule" has the tables.
//
// Across hosts, allreduce has a third schedule, hierarchical (through one leader per host), which
// KOLO_ALLREDUCE chooses or leaves to auto.
//
// The choice depends only on the message size, N, KOLO_ALLREDUCE and the shape of the host map,
// all of which every rank shares, so every rank makes the same one; the descriptor carries it all
// the same (a rank built with other constants reports a mismatch).
#pragma once

#include <cstdint>

#include "core/op_descriptor.hpp"

namespace kolo {

// The switch points can be moved at build time, to measure them again:
//   meson setup build-ring -Dcpp_args=-DKOLO_RECURSIVE_DOUBLING_MAX_BYTES=0 (rings only, but for
//   empty buffers), or a huge value for the latency-optimal schedules only; likewise
//   KOLO_BRUCK_MAX_BYTES.
#ifndef KOLO_RECURSIVE_DOUBLING_MAX_BYTES
#define KOLO_RECURSIVE_DOUBLING_MAX_BYTES (32u << 10)  // per rank: 64 KiB at N = 2, 160 at 5
#endif
#ifndef KOLO_BRUCK_MAX_BYTES
#define KOLO_BRUCK_MAX_BYTES (128u << 10)
#endif

// Recursive doubling runs for buffers of at most this many bytes times N: the ring's latency
// grows with N (2(N-1) steps against log2 N), so the size where its bandwidth wins does too.
inline constexpr uint64_t kRecursiveDoublingMaxBytesPerRank = KOLO_RECURSIVE_DOUBLING_MAX_BYTES;
// Recursive doubling's one-shot form (ring/allreduce_recursive_doubling.cpp) runs where shared
// memory links every pair, for at most this many ranks and while a rank sends at most this many
// bytes ((N - 1) x its partial). The limits come from a first sweep on 2 cores (kolorun -np N
// all_reduce_perf -b 8 -e 128K -f 4, one shot / exchanges, medians of three alternating runs of a
// build that could switch): one shot lost at N = 4 with 128 KiB (1.35) and at N = 8 with 32 KiB
// (1.32), and broke even at N = 3 with 32 KiB (1.00) and N = 8 with 8 KiB (0.96); below, it won
// but for one size at N = 4 (32 B: 1.35, where single runs flip between two speeds). Over TCP on
// loopback it lost (N = 4: 1.04-1.51, 0.98 at 2 KiB). docs/tuning.md ("Recursive doubling in one
// shot") and docs/performance.md ("Small messages") have the measured result.
inline constexpr int kOneShotMaxRanks = 8;
inline constexpr uint64_t kOneShotMaxBytes = 32u << 10;
// Total bytes of the gathered buffer at and below which Bruck's allgather runs.
inline constexpr uint64_t kBruckMaxBytes = KOLO_BRUCK_MAX_BYTES;

// KOLO_ALLREDUCE: which allreduce schedules the dispatcher may choose from.
enum class AllreduceMode : uint8_t {
  kAuto,          // hierarchical for small buffers across hosts with several ranks, else flat
  kRing,          // flat: the ring, or recursive doubling for small buffers
  kHierarchical,  // always through the host leaders
};

// What the allreduce dispatcher knows of the hosts: the same on every rank (every rank derives it
// from the host map exchanged at start-up, ring/ring.hpp's HostMap).
struct HostShape {
  int hosts = 1;          // hosts the communicator spans
  int largest_host = 1;   // ranks on its most crowded host
  int smallest_host = 1;  // and on its least crowded one
  // Steps in which some message crosses between hosts (each costs a network latency): of
  // recursive doubling over all ranks, and of the hierarchical schedule (recursive doubling over
  // the host leaders).
  int flat_network_steps = 0;
  int hierarchical_network_steps = 0;
};

// The flat schedules, by size and N only.
inline Algorithm flat_allreduce_algorithm(uint64_t bytes, int ranks) {
  // With two ranks recursive doubling is one exchange where the ring takes two steps: it wins
  // there too.
  return ranks > 1 && bytes <= kRecursiveDoublingMaxBytesPerRank * static_cast<uint64_t>(ranks)
             ? Algorithm::kRecursiveDoubling
             : Algorithm::kRing;
}

// Whether KOLO_ALLREDUCE=auto runs the hierarchical schedule where the flat choice would be
// recursive doubling: when the communicator spans several hosts and some host has more than one of
// its ranks, unless recursive doubling crosses between hosts in fewer steps. Both are latency
// schedules (every message holds the whole buffer). Where the hosts do not line up with recursive
// doubling's pairs (N or the ranks per host not a power of two, hosts of uneven sizes, ranks not
// numbered host by host) it crosses the network in more steps than the leaders do. Where they do
// line up (2 hosts x 2 ranks, 4 x 2, ...) the steps between hosts are as many, but in each of them
// every rank of a host sends its whole buffer over the host's link at once, where only the leader
// does here, and the steps inside a host cost little over kolo's shared-memory rings: measured on
// the simulated cluster, the hierarchical schedule took 0.43-0.81 of recursive doubling's time at
// 8 bytes and 0.25-0.53 at 32 KiB, at 2 x 2, 2 x 3 and 4 x 2 (docs/performance.md, "Hierarchical
// allreduce on the cluster"). Above recursive doubling's size limit the flat ring runs.
inline bool hierarchical_pays(const HostShape& shape) {
  return shape.hosts > 1 && shape.largest_host > 1 &&
         shape.hierarchical_network_steps <= shape.flat_network_steps;
}

// Whether the hierarchical schedule by shards can run: several hosts, each with the same number
// of ranks, more than one. Above recursive doubling's size limit it replaces the flat ring: each
// host's link then carries 2(H-1)/H of the buffer each way instead of 2(N-1)/N, and no rank ever
// holds more than its shard beyond its own buffer (ring/allreduce_hierarchical.cpp).
inline bool shards_fit(const HostShape& shape) {
  return shape.hosts > 1 && shape.largest_host > 1 && shape.smallest_host == shape.largest_host;
}

// The schedule KOLO_ALLREDUCE, the hosts, the size and N give: identical on every rank of a
// communicator, since all of them are (the mode is checked at start-up, comm/communicator.cpp).
// Hierarchical runs through the leaders where the flat choice is recursive doubling, by shards
// where it is the ring and the hosts are even; through the leaders at every size otherwise.
inline Algorithm allreduce_algorithm(uint64_t bytes, int ranks, AllreduceMode mode,
                                     const HostShape& shape) {
  const Algorithm flat = flat_allreduce_algorithm(bytes, ranks);
  if (ranks <= 1 || mode == AllreduceMode::kRing) return flat;
  if (flat == Algorithm::kRing && shards_fit(shape)) return Algorithm::kHierarchicalShards;
  if (mode == AllreduceMode::kHierarchical ||
      (flat == Algorithm::kRecursiveDoubling && hierarchical_pays(shape))) {
    return Algorithm::kHierarchical;
  }
  return flat;
}

inline Algorithm allgather_algorithm(uint64_t total_bytes, int ranks) {
  // Bruck takes fewer steps than the ring, ceil(log2 N) < N-1, from four ranks on; with two or
  // three the step counts are equal and the ring's pipelining makes it the better one.
  return ranks >= 4 && total_bytes <= kBruckMaxBytes ? Algorithm::kBruck : Algorithm::kRing;
}

}  // namespace kolo
