// The fusion engine's executor: runs the batches of a response, every rank the same collectives
// in the same order, fused through the fusion buffer (fused_layout.hpp), or in the callers'
// buffers: several on one ring (Batch::one_ring) or each alone. It owns the fusion buffer and the
// sequence numbers of the engine's collectives; the engine (engine.hpp) matches a response to this
// rank's submissions and hands it the requests. Engine thread only, except stats().
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "core/deadline.hpp"
#include "core/op_descriptor.hpp"
#include "core/page_buffer.hpp"
#include "fusion/fusion_cost.hpp"
#include "fusion/request.hpp"
#include "fusion/wire.hpp"

namespace kolo {
class Ring;
namespace fusion {

class Timeline;

// What the executor has done, for FusionStats.
struct ExecutorStats {
  uint64_t collectives = 0;          // collectives run
  uint64_t fused_collectives = 0;    // of which through the fusion buffer
  uint64_t tensors_fused = 0;        // tensors that went through the fusion buffer
  uint64_t bytes_copied = 0;         // into and out of the fusion buffer
  uint64_t fusion_buffer_bytes = 0;  // its size now
  uint64_t payload_bytes = 0;        // the tensors' bytes the collectives carried (autotune.hpp)
  uint64_t collective_ns = 0;        // wall time inside those collectives (the probes left out)
  uint64_t copy_ns = 0;              // wall time copying into and out of the fusion buffer
};

class Executor {
 public:
  explicit Executor(int size);

  // The ring to run on and the trace to write (or nullptr), once the engine has connected.
  void attach(Ring* ring, Timeline* timeline);

  // Runs one batch of a response: `requests` are this rank's, in the batch's order, `received`
  // when the response arrived. The fusion buffer is sized at least `fusion_threshold` bytes when
  // first needed. Once it returns, every request of the batch has run to the end (the engine
  // completes them; a batch that is neither fused nor on one ring holds one unit). Throws
  // kolo::Error when a collective fails.
  void run(const Batch& batch, const std::vector<const Request*>& requests,
           Clock::time_point received, uint64_t fusion_threshold);

  // Before the batches of each response (FusionCost::start_response).
  void start_response() { cost_.start_response(); }

  ExecutorStats stats() const;

  // Runs `rounds` allreduces of one float per rank on every rank, after three to warm up, each
  // timed into cost() as a collective's latency (fusion_cost.hpp); not counted in stats().
  void probe_latency(int rounds);
  // What fusing costs and saves, measured from the collectives run so far.
  const FusionCost& cost() const { return cost_; }

 private:
  void run_fused(const std::vector<const Request*>& requests, Clock::time_point received,
                 uint64_t fusion_threshold);
  void run_alone(const Request& request, Clock::time_point received);
  void run_on_one_ring(const std::vector<const Request*>& requests, Clock::time_point received);
  void run_allgather(const Request& request, const std::vector<uint64_t>& counts,
                     Clock::time_point received);
  std::byte* fusion_buffer(size_t bytes, uint64_t fusion_threshold);
  // By descriptor.algorithm: the ring or recursive doubling (engine_algorithm() in spec.hpp).
  void allreduce(const OpDescriptor& descriptor, const void* send, void* recv);
  void count(const ExecutorStats& more);

  const int size_;
  Ring* ring_ = nullptr;
  Timeline* timeline_ = nullptr;
  uint64_t sequence_ = 0;  // of the collectives on the engine's ring
  PageBuffer buffer_;
  FusionCost cost_;
  mutable std::mutex stats_mutex_;
  ExecutorStats stats_;
};

}  // namespace fusion
}  // namespace kolo
