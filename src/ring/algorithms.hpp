// Which schedule a collective uses. The rings are bandwidth-optimal but cost a message latency
// per step, 2(N-1) steps for allreduce and N-1 for allgather; below a size the latency-optimal
// schedules win: recursive doubling for allreduce (log2 N steps, two more when N is not a power
// of two) and Bruck's allgather (ceil(log2 N) steps). The switch points were measured with
// bench/allreduce_perf and bench/all_gather_perf at N = 2..5 on one machine; the README's
// "Choosing the algorithm" has the tables.
//
// The choice depends only on the message size and N, so every rank makes the same one; the
// descriptor carries it all the same (a rank built with other constants reports a mismatch).
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
// Total bytes of the gathered buffer at and below which Bruck's allgather runs.
inline constexpr uint64_t kBruckMaxBytes = KOLO_BRUCK_MAX_BYTES;

inline Algorithm allreduce_algorithm(uint64_t bytes, int ranks) {
  // With two ranks recursive doubling is one exchange where the ring takes two steps: it wins
  // there too.
  return ranks > 1 && bytes <= kRecursiveDoublingMaxBytesPerRank * static_cast<uint64_t>(ranks)
             ? Algorithm::kRecursiveDoubling
             : Algorithm::kRing;
}

inline Algorithm allgather_algorithm(uint64_t total_bytes, int ranks) {
  // Bruck takes fewer steps than the ring, ceil(log2 N) < N-1, from four ranks on; with two or
  // three the step counts are equal and the ring's pipelining makes it the better one.
  return ranks >= 4 && total_bytes <= kBruckMaxBytes ? Algorithm::kBruck : Algorithm::kRing;
}

}  // namespace kolo
