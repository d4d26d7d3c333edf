// The fusion engine's executor (executor.hpp; engine.cpp has the essay).
#include "fusion/executor.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "fusion/fused_layout.hpp"
#include "fusion/timeline.hpp"
#include "ring/algorithms.hpp"
#include "ring/ring.hpp"

namespace kolo::fusion {

namespace {

uint64_t nanoseconds(Clock::duration duration) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(duration).count());
}

// The descriptor of an allreduce of `count` elements with spec's dtype, op and factors.
OpDescriptor allreduce_of(const UnitSpec& spec, uint64_t count, Algorithm algorithm) {
  OpDescriptor descriptor;
  descriptor.collective = Collective::kAllreduce;
  descriptor.dtype = spec.dtype;
  descriptor.op = spec.op;
  descriptor.prescale = spec.prescale;
  descriptor.postscale = spec.postscale;
  descriptor.count = count;
  descriptor.algorithm = algorithm;
  return descriptor;
}

}  // namespace

Executor::Executor(int size) : size_(size) {}

void Executor::attach(Ring* ring, Timeline* timeline) {
  ring_ = ring;
  timeline_ = timeline;
}

ExecutorStats Executor::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

void Executor::count(const ExecutorStats& more) {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  stats_.collectives += more.collectives;
  stats_.fused_collectives += more.fused_collectives;
  stats_.tensors_fused += more.tensors_fused;
  stats_.bytes_copied += more.bytes_copied;
  stats_.payload_bytes += more.payload_bytes;
  stats_.collective_ns += more.collective_ns;
  stats_.copy_ns += more.copy_ns;
}

void Executor::run(const Batch& batch, const std::vector<const Request*>& requests,
                   Clock::time_point received, uint64_t fusion_threshold) {
  if (batch.fused) {
    run_fused(requests, received, fusion_threshold);
    return;
  }
  if (batch.one_ring) {
    run_on_one_ring(requests, received);
    return;
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    // An allgather is never a cache hit (coordinator.hpp): its scheduled spec, with every rank's
    // count, is in the response.
    if (requests[i]->spec().kind == Kind::kAllgather) {
      run_allgather(*requests[i], batch.units[i].spec.gather_counts, received);
    } else {
      run_alone(*requests[i], received);
    }
  }
}

void Executor::probe_latency(int rounds) {
  // The first few collectives on fresh connections take 10 to 100 times longer (measured over
  // the shared-memory rings: 132, 17, 3.7, then 1.0-1.2 us on rank 0).
  constexpr int kWarmUp = 3;
  std::vector<float> data(size_, 1.0f);
  OpDescriptor descriptor;
  descriptor.collective = Collective::kAllreduce;
  descriptor.dtype = DataType::kFloat32;
  descriptor.op = ReduceOp::kSum;
  descriptor.count = data.size();
  descriptor.algorithm = flat_allreduce_algorithm(data.size() * sizeof(float), size_);
  for (int round = -kWarmUp; round < rounds; ++round) {
    descriptor.sequence = ++sequence_;
    const Clock::time_point start = Clock::now();
    allreduce(descriptor, data.data(), data.data());
    if (round >= 0) cost_.alone(data.size() * sizeof(float), Clock::now() - start);
  }
}

void Executor::allreduce(const OpDescriptor& descriptor, const void* send, void* recv) {
  if (descriptor.algorithm == Algorithm::kRecursiveDoubling) {
    recursive_doubling_allreduce(*ring_, descriptor, send, recv);
  } else {
    ring_allreduce(*ring_, descriptor, send, recv);
  }
}

// Every rank's block in rank order into the caller's receive buffer, as kolo_allgatherv does (the
// ring, or Bruck's schedule for small totals at four ranks or more: no arithmetic, so the choice
// cannot change a result). Elements of recvbuf past the gathered total are not touched.
void Executor::run_allgather(const Request& request, const std::vector<uint64_t>& counts,
                             Clock::time_point received) {
  const UnitSpec& spec = request.spec();
  const MemberBuffers& buffers = request.buffers().front();
  const Blocks blocks = Blocks::from_counts(counts);  // the total was checked by rank 0 and here
  OpDescriptor descriptor;
  descriptor.collective = Collective::kAllgatherv;
  descriptor.dtype = spec.dtype;
  descriptor.count = blocks.total;
  descriptor.detail = hash_counts(counts);
  descriptor.algorithm = allgather_algorithm(blocks.total * dtype_size(spec.dtype), size_);
  descriptor.sequence = ++sequence_;
  const Clock::time_point start = Clock::now();
  allgather_blocks(*ring_, descriptor, buffers.send, buffers.recv, blocks);
  const Clock::time_point end = Clock::now();
  cost_.ran();
  count({.collectives = 1,
         .payload_bytes = blocks.total * dtype_size(spec.dtype),
         .collective_ns = nanoseconds(end - start)});
  if (timeline_) {
    uint32_t row = timeline_->row(spec.key());
    timeline_->span(row, "QUEUE", received, start);
    timeline_->span(row, "ALLGATHER", start, end,
                    Timeline::collective_args(descriptor.sequence, 1,
                                              blocks.total * dtype_size(spec.dtype), spec, false));
  }
}

// One collective per member, in the caller's buffers.
void Executor::run_alone(const Request& request, Clock::time_point received) {
  const UnitSpec& spec = request.spec();
  const std::vector<MemberBuffers>& buffers = request.buffers();
  for (size_t m = 0; m < spec.members.size(); ++m) {
    OpDescriptor descriptor;
    descriptor.collective =
        spec.kind == Kind::kBroadcast ? Collective::kBroadcast : Collective::kAllreduce;
    descriptor.dtype = spec.dtype;
    descriptor.count = spec.members[m].count;
    descriptor.sequence = ++sequence_;
    const Clock::time_point start = Clock::now();
    if (spec.kind == Kind::kBroadcast) {
      descriptor.root = spec.root;
      ring_broadcast(*ring_, descriptor, buffers[m].recv);
    } else {
      descriptor.op = spec.op;
      descriptor.prescale = spec.prescale;
      descriptor.postscale = spec.postscale;
      // A group's members by the group's schedule, like the group fused.
      descriptor.algorithm = engine_algorithm(spec, size_);
      allreduce(descriptor, buffers[m].send, buffers[m].recv);
    }
    const Clock::time_point end = Clock::now();
    const uint64_t bytes = spec.members[m].count * dtype_size(spec.dtype);
    if (spec.kind == Kind::kAllreduce) {
      cost_.alone(bytes, end - start);
    } else {
      cost_.ran();
    }
    count({.collectives = 1, .payload_bytes = bytes, .collective_ns = nanoseconds(end - start)});
    if (timeline_) {
      uint32_t row = timeline_->row(spec.members[m].name);
      timeline_->span(row, "QUEUE", received, start);
      timeline_->span(
          row, spec.kind == Kind::kBroadcast ? "BROADCAST" : "ALLREDUCE", start, end,
          Timeline::collective_args(descriptor.sequence, 1,
                                    spec.members[m].count * dtype_size(spec.dtype), spec, false));
    }
  }
}

// Every member of every request in one ring allreduce over their buffers, without copying.
void Executor::run_on_one_ring(const std::vector<const Request*>& requests,
                               Clock::time_point received) {
  const UnitSpec& first = requests.front()->spec();
  const size_t element = dtype_size(first.dtype);
  std::vector<AllreducePiece> pieces;
  for (const Request* request : requests) {
    const std::vector<MemberBuffers>& buffers = request->buffers();
    for (size_t m = 0; m < buffers.size(); ++m) {
      pieces.push_back({buffers[m].send, buffers[m].recv, request->spec().members[m].count});
    }
  }
  uint64_t elements = 0;
  for (const AllreducePiece& piece : pieces) elements += piece.count;
  OpDescriptor descriptor = allreduce_of(first, elements, Algorithm::kRing);
  descriptor.sequence = ++sequence_;
  const Clock::time_point start = Clock::now();
  ring_allreduce_pieces(*ring_, descriptor, pieces);
  const Clock::time_point end = Clock::now();
  const uint64_t bytes = descriptor.count * element;
  cost_.alone(bytes, end - start);
  count({.collectives = 1, .payload_bytes = bytes, .collective_ns = nanoseconds(end - start)});
  if (timeline_) {
    const std::string args =
        Timeline::collective_args(descriptor.sequence, pieces.size(), bytes, first, false);
    for (const Request* request : requests) {
      for (const Member& member : request->spec().members) {
        uint32_t row = timeline_->row(member.name);
        timeline_->span(row, "QUEUE", received, start);
        timeline_->span(row, "ALLREDUCE", start, end, args);
      }
    }
  }
}

// Every member of every request through the fusion buffer, in one allreduce.
void Executor::run_fused(const std::vector<const Request*>& requests, Clock::time_point received,
                         uint64_t fusion_threshold) {
  const UnitSpec& first = requests.front()->spec();
  const size_t element = dtype_size(first.dtype);
  struct Placed {
    const UnitSpec* spec;
    size_t member;
    const MemberBuffers* buffers;
  };
  std::vector<Placed> placed;
  std::vector<uint64_t> counts;
  uint64_t payload = 0;
  for (const Request* request : requests) {
    const UnitSpec& spec = request->spec();
    for (size_t m = 0; m < spec.members.size(); ++m) {
      placed.push_back({&spec, m, &request->buffers()[m]});
      counts.push_back(spec.members[m].count);
      payload += spec.members[m].count * element;
    }
  }
  const FusedLayout layout(counts, size_);
  std::byte* buffer = fusion_buffer(layout.total_elements() * element, fusion_threshold);

  const bool timed = timeline_ != nullptr;
  std::vector<Clock::time_point> marks(timed ? placed.size() + 1 : 0);
  const Clock::time_point start = Clock::now();
  if (timed) marks[0] = start;
  for (size_t i = 0; i < placed.size(); ++i) {
    layout.copy_in(i, placed[i].buffers->send, buffer, element);
    if (timed) marks[i + 1] = Clock::now();
  }
  layout.zero_padding(buffer, element);

  // The schedule is the same for every unit (fusable()).
  OpDescriptor descriptor =
      allreduce_of(first, layout.total_elements(), engine_algorithm(first, size_));
  descriptor.sequence = ++sequence_;
  const Clock::time_point reduce_start = Clock::now();
  allreduce(descriptor, buffer, buffer);
  const Clock::time_point reduce_end = Clock::now();
  cost_.ran();

  std::vector<Clock::time_point> out_marks(timed ? placed.size() + 1 : 0);
  if (timed) out_marks[0] = reduce_end;
  for (size_t i = 0; i < placed.size(); ++i) {
    layout.copy_out(i, buffer, placed[i].buffers->recv, element);
    if (timed) out_marks[i + 1] = Clock::now();
  }
  const Clock::duration copying = (reduce_start - start) + (Clock::now() - reduce_end);
  cost_.copied(payload, placed.size(), copying);
  count({.collectives = 1,
         .fused_collectives = 1,
         .tensors_fused = placed.size(),
         .bytes_copied = 2 * payload,
         .payload_bytes = payload,
         .collective_ns = nanoseconds(reduce_end - reduce_start),
         .copy_ns = nanoseconds(copying)});
  if (timed) {
    const std::string args =
        Timeline::collective_args(descriptor.sequence, placed.size(), payload, first, true);
    for (size_t i = 0; i < placed.size(); ++i) {
      uint32_t row = timeline_->row(placed[i].spec->members[placed[i].member].name);
      timeline_->span(row, "QUEUE", received, start);
      timeline_->span(row, "COPY_IN", marks[i], marks[i + 1]);
      timeline_->span(row, "ALLREDUCE", reduce_start, reduce_end, args);
      timeline_->span(row, "COPY_OUT", out_marks[i], out_marks[i + 1]);
    }
  }
}

std::byte* Executor::fusion_buffer(size_t bytes, uint64_t fusion_threshold) {
  if (bytes > buffer_.size()) {
    // Allocated once at the threshold (pages are touched only as far as they are used), larger
    // only for a group that exceeds it.
    size_t size = std::max<size_t>(bytes, fusion_threshold);
    buffer_.release();
    buffer_ = PageBuffer(size);
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.fusion_buffer_bytes = size;
  }
  return buffer_.data();
}

}  // namespace kolo::fusion
