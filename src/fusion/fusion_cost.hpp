// Rank 0's measure of what fusing a tensor saves and what it costs, from which the coordinator
// takes the size at which a single tensor runs alone instead (coordinator.hpp).
//
// Fusing a tensor of b bytes saves one collective's fixed cost α (the latency of a small
// collective, recursive doubling's log2 N exchanges, and the engine's bookkeeping for it) and
// costs copying it into and out of the fusion buffer, b·γ; the cost per byte on the wire is the
// same either way. So a tensor is worth fusing while b < α/γ, and that quotient is the alone
// size, never above kAloneBytes (beyond a megabyte the fusion buffer also falls out of cache).
// What the two are depends on the machine and the transport far more than on the model: on one
// host α is a few microseconds at N = 2 and γ a fraction of a nanosecond per byte, so only
// tensors of kilobytes are worth fusing (a ResNet-50 step over the shared-memory rings at N = 2
// took 24.6 ms with everything below a megabyte fused, 22.0 ms with this rule, 21.2 ms as ordered
// calls); across hosts α is tens to hundreds of microseconds and the alone size stays at
// kAloneBytes.
//
// α: the median of the last kSamples collectives of at most kLatencyBytes that ran alone, the
// first ones the latency probe that every engine runs when it connects (Executor::probe_latency),
// leaving out the first collective of each response: it also waits for the ranks that read the
// response or woke later than this one, which fusing does not save (it is paid once a response
// either way). Counted, those waits became α within a few steps of a training loop, where the
// first collective is often the only small one alone: over the shared-memory rings at N = 2,
// ResNet-50's fc.bias (4000 bytes, first in its response) took 143 us on average on rank 0 and
// 8.4 us on rank 1, rank 0 logged α rising from the probes' 1 us to 14 and 32 us within 30 steps,
// and in 20 of 32 steps one fused batch of 5.8 MB held nearly every tensor below a megabyte.
// γ: the median of the last kSamples fused collectives' copy time (in and out) per byte, counting
// only those that carried at least kCopyBytes in tensors of kCopyTensorBytes or more on average.
// Below either, the per-tensor cost of the copy loop dominates, and counting it as a cost per byte
// made γ several times too high: 400 tensors of 4-388 bytes copied at about 1 ns per byte, against
// 0.1-0.3 ns for tensors of kilobytes, which with α = 0.4 us over the shared-memory rings at N = 2
// sent tensors of 360 bytes or more alone, one collective each. Until kMinCopySamples fused
// collectives have been measured (one preempted copy loop is not a machine's speed), the alone size
// is kAloneBytes: kolo starts as it always did and fuses less only once it has measured that it
// pays.
// Engine thread only.
#pragma once

#include <cstdint>
#include <deque>

#include "core/deadline.hpp"

namespace kolo::fusion {

class FusionCost {
 public:
  static constexpr uint64_t kLatencyBytes = 4096;
  static constexpr uint64_t kCopyBytes = 64 * 1024;
  static constexpr uint64_t kCopyTensorBytes = 4096;
  static constexpr size_t kSamples = 15;
  static constexpr size_t kMinCopySamples = 3;

  // A response arrived: the next collective is its first (not a latency sample, see above).
  void start_response() { aligned_ = false; }
  // A collective other than an allreduce alone ran (a fused one, a broadcast, an allgather).
  void ran() { aligned_ = true; }
  // An allreduce that carried `bytes` alone, taking `elapsed`.
  void alone(uint64_t bytes, Clock::duration elapsed);
  // A fused collective's copies of `bytes` in `tensors` tensors into and out of the fusion
  // buffer, taking `elapsed`.
  void copied(uint64_t bytes, uint64_t tensors, Clock::duration elapsed);

  // Single tensors at least this large run alone: α/γ, at most kAloneBytes, kAloneBytes until
  // α and kMinCopySamples of γ are measured.
  uint64_t alone_bytes() const;
  // The medians in seconds and seconds per byte; 0 before any sample.
  double latency_s() const;
  double copy_s_per_byte() const;

 private:
  std::deque<double> latency_, copy_;
  bool aligned_ = true;  // a collective has run since start_response()
};

}  // namespace kolo::fusion
