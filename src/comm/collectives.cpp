// The collectives beyond allreduce, broadcast and barrier, and point to point: the arguments are
// checked here, on this rank, before anything is sent (a bad argument leaves the communicator
// usable), then the call is described in an OpDescriptor and handed to its algorithm in src/ring/.
#include <fmt/format.h>

#include <algorithm>
#include <string_view>
#include <vector>

#include "comm/communicator.hpp"
#include "core/arguments.hpp"
#include "ring/algorithms.hpp"
#include "ring/ring.hpp"

namespace kolo {
namespace {

using arguments::check_dtype;
using arguments::check_in_place;
using arguments::check_op;
using arguments::checked_offsets;
using arguments::checked_total;
using arguments::kMaxBufferBytes;

Error invalid(const std::string& message) {
  return Error(Status::kInvalidArgument, message);
}

void check_vector_shape(std::span<const uint64_t> counts, int ranks, const char* call,
                        const char* name) {
  arguments::check_per_rank(counts.data(), counts.size(), ranks, call, name);
}

}  // namespace

// ---- allgather and reduce-scatter
// ----------------------------------------------------------------

namespace {

void check_buffer(const char* call, const char* name, const void* buffer, uint64_t count,
                  int rank) {
  if (buffer == nullptr && count > 0) {
    throw invalid(fmt::format("{}: {} is NULL but holds {} elements here (rank {})", call, name,
                              count, rank));
  }
}

// The blocks of allgather(v) and reduce-scatter(v), checked: the counts, their sum, the buffers
// (`whole` holds every block, `part` this rank's) and the in-place rule.
Blocks checked_blocks(const char* call, std::span<const uint64_t> counts, DataType dtype, int rank,
                      int size, const void* part, const char* part_name, const void* whole,
                      const char* whole_name) {
  check_dtype(dtype, call);
  check_vector_shape(counts, size, call, "counts");
  const size_t element = dtype_size(dtype);
  checked_total(counts, element, call, "counts");
  Blocks blocks = Blocks::from_counts(counts);
  check_buffer(call, part_name, part, counts[rank], rank);
  check_buffer(call, whole_name, whole, blocks.total, rank);
  check_in_place(
      part, counts[rank] * element, whole, blocks.total * element, blocks.offsets[rank] * element,
      call, fmt::format("in place, {} is this rank's block of {}", part_name, whole_name).c_str());
  return blocks;
}

std::vector<uint64_t> equal_counts(const char* call, uint64_t count, DataType dtype, int size) {
  check_dtype(dtype, call);
  if (count > kMaxBufferBytes / dtype_size(dtype) / static_cast<uint64_t>(size)) {
    throw invalid(fmt::format("{}: count {} of {} times {} ranks is too large", call, count,
                              dtype_name(dtype), size));
  }
  return std::vector<uint64_t>(static_cast<size_t>(size), count);
}

}  // namespace

void Communicator::allgather(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype) {
  const std::vector<uint64_t> counts = equal_counts("allgather", count, dtype, size());
  const Blocks blocks = checked_blocks("allgather", counts, dtype, rank(), size(), sendbuf,
                                       "sendbuf", recvbuf, "recvbuf");
  OpDescriptor descriptor;
  descriptor.collective = Collective::kAllgather;
  descriptor.dtype = dtype;
  descriptor.count = count;
  descriptor.algorithm = allgather_algorithm(blocks.total * dtype_size(dtype), size());
  if (gpu::is_device_memory(sendbuf) || gpu::is_device_memory(recvbuf)) {
    return gpu_allgather(descriptor, sendbuf, recvbuf, blocks);  // comm/communicator_gpu.cpp
  }
  run_collective(descriptor, [&](const OpDescriptor& d) {
    allgather_blocks(*ring_, d, sendbuf, recvbuf, blocks);
  });
}

void Communicator::allgatherv(const void* sendbuf, void* recvbuf, std::span<const uint64_t> counts,
                              DataType dtype) {
  const Blocks blocks = checked_blocks("allgatherv", counts, dtype, rank(), size(), sendbuf,
                                       "sendbuf", recvbuf, "recvbuf");
  OpDescriptor descriptor;
  descriptor.collective = Collective::kAllgatherv;
  descriptor.dtype = dtype;
  descriptor.count = blocks.total;
  descriptor.detail = hash_counts(counts);
  descriptor.algorithm = allgather_algorithm(blocks.total * dtype_size(dtype), size());
  run_collective(descriptor, [&](const OpDescriptor& d) {
    allgather_blocks(*ring_, d, sendbuf, recvbuf, blocks);
  });
}

void Communicator::reduce_scatter(const void* sendbuf, void* recvbuf, uint64_t count,
                                  DataType dtype, ReduceOp op) {
  const std::vector<uint64_t> counts = equal_counts("reduce_scatter", count, dtype, size());
  check_op(op, "reduce_scatter");
  const Blocks blocks = checked_blocks("reduce_scatter", counts, dtype, rank(), size(), recvbuf,
                                       "recvbuf", sendbuf, "sendbuf");
  OpDescriptor descriptor;
  descriptor.collective = Collective::kReduceScatter;
  descriptor.dtype = dtype;
  descriptor.op = op;
  descriptor.count = count;
  if (gpu::is_device_memory(sendbuf) || gpu::is_device_memory(recvbuf)) {
    return gpu_reduce_scatter(descriptor, sendbuf, recvbuf, blocks);  // comm/communicator_gpu.cpp
  }
  run_collective(descriptor, [&](const OpDescriptor& d) {
    ring_reduce_scatter(*ring_, d, sendbuf, recvbuf, blocks);
  });
}

void Communicator::reduce_scatterv(const void* sendbuf, void* recvbuf,
                                   std::span<const uint64_t> counts, DataType dtype, ReduceOp op) {
  check_op(op, "reduce_scatterv");
  const Blocks blocks = checked_blocks("reduce_scatterv", counts, dtype, rank(), size(), recvbuf,
                                       "recvbuf", sendbuf, "sendbuf");
  OpDescriptor descriptor;
  descriptor.collective = Collective::kReduceScatterv;
  descriptor.dtype = dtype;
  descriptor.op = op;
  descriptor.count = blocks.total;
  descriptor.detail = hash_counts(counts);
  run_collective(descriptor, [&](const OpDescriptor& d) {
    ring_reduce_scatter(*ring_, d, sendbuf, recvbuf, blocks);
  });
}

// ---- alltoall -----------------------------------------------------------------------------------

void Communicator::alltoall(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype) {
  check_dtype(dtype, "alltoall");
  const auto ranks = static_cast<uint64_t>(size());
  if (count > kMaxBufferBytes / dtype_size(dtype) / ranks) {
    throw invalid(fmt::format("alltoall: count {} of {} times {} ranks is too large", count,
                              dtype_name(dtype), size()));
  }
  arguments::check_buffer(sendbuf, count * ranks, dtype, "alltoall: sendbuf", rank());
  arguments::check_buffer(recvbuf, count * ranks, dtype, "alltoall: recvbuf", rank());
  AlltoallLayout layout;
  for (uint64_t p = 0; p < ranks; ++p) {
    layout.send_counts.push_back(count);
    layout.send_offsets.push_back(p * count);
  }
  layout.recv_counts = layout.send_counts;
  layout.recv_offsets = layout.send_offsets;
  OpDescriptor descriptor;
  descriptor.collective = Collective::kAlltoall;
  descriptor.dtype = dtype;
  descriptor.count = count;
  run_collective(descriptor, [&](const OpDescriptor& d) {
    pairwise_alltoall(*ring_, d, sendbuf, recvbuf, layout);
  });
}

void Communicator::alltoallv(const void* sendbuf, std::span<const uint64_t> send_counts,
                             std::span<const int64_t> send_displacements, void* recvbuf,
                             std::span<const uint64_t> recv_counts,
                             std::span<const int64_t> recv_displacements, DataType dtype) {
  constexpr const char* kCall = "alltoallv";
  check_dtype(dtype, kCall);
  check_vector_shape(send_counts, size(), kCall, "sendcounts");
  check_vector_shape(recv_counts, size(), kCall, "recvcounts");
  for (auto [displacements, name] :
       {std::pair{send_displacements, "sdispls"}, std::pair{recv_displacements, "rdispls"}}) {
    arguments::check_per_rank(displacements.data(), displacements.size(), size(), kCall, name);
  }
  const size_t element = dtype_size(dtype);
  AlltoallLayout layout;
  layout.send_counts.assign(send_counts.begin(), send_counts.end());
  layout.recv_counts.assign(recv_counts.begin(), recv_counts.end());
  checked_offsets(send_counts, send_displacements, element, kCall, "sendcounts", "sdispls",
                  layout.send_offsets);
  checked_offsets(recv_counts, recv_displacements, element, kCall, "recvcounts", "rdispls",
                  layout.recv_offsets);
  for (int p = 0; p < size(); ++p) {
    if (sendbuf == nullptr && send_counts[p] > 0) {
      throw invalid(fmt::format("{}: sendbuf is NULL but sendcounts[{}] is {} (rank {})", kCall, p,
                                send_counts[p], rank()));
    }
    if (recvbuf == nullptr && recv_counts[p] > 0) {
      throw invalid(fmt::format("{}: recvbuf is NULL but recvcounts[{}] is {} (rank {})", kCall, p,
                                recv_counts[p], rank()));
    }
  }
  if (send_counts[rank()] != recv_counts[rank()]) {
    throw invalid(
        fmt::format("{}: rank {} sends itself {} elements but expects {} "
                    "(sendcounts[{}] != recvcounts[{}])",
                    kCall, rank(), send_counts[rank()], recv_counts[rank()], rank(), rank()));
  }
  // Two blocks landing on the same elements would make the result depend on timing.
  std::vector<int> order;
  for (int p = 0; p < size(); ++p) {
    if (recv_counts[p] > 0) order.push_back(p);
  }
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return layout.recv_offsets[a] < layout.recv_offsets[b]; });
  for (size_t i = 1; i < order.size(); ++i) {
    const int before = order[i - 1];
    const int after = order[i];
    if (layout.recv_offsets[before] + recv_counts[before] > layout.recv_offsets[after]) {
      throw invalid(
          fmt::format("{}: the blocks from ranks {} and {} overlap in recvbuf (rdispls "
                      "{} and {}, recvcounts {} and {})",
                      kCall, before, after, layout.recv_offsets[before], layout.recv_offsets[after],
                      recv_counts[before], recv_counts[after]));
    }
  }
  OpDescriptor descriptor;
  descriptor.collective = Collective::kAlltoallv;
  descriptor.dtype = dtype;
  run_collective(descriptor, [&](const OpDescriptor& d) {
    pairwise_alltoall(*ring_, d, sendbuf, recvbuf, layout);
  });
}

// ---- reduce -------------------------------------------------------------------------------------

void Communicator::reduce(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype,
                          ReduceOp op, int root) {
  check_dtype(dtype, "reduce");
  check_op(op, "reduce");
  arguments::check_root(root, size(), "reduce");
  arguments::check_buffer(sendbuf, count, dtype, "reduce: sendbuf", rank());
  if (rank() == root) {
    arguments::check_buffer(recvbuf, count, dtype, "reduce: recvbuf (on the root)", rank());
    const uint64_t bytes = count * dtype_size(dtype);
    check_in_place(sendbuf, bytes, recvbuf, bytes, 0, "reduce",
                   "in place, sendbuf == recvbuf on the root");
  }
  OpDescriptor descriptor;
  descriptor.collective = Collective::kReduce;
  descriptor.dtype = dtype;
  descriptor.op = op;
  descriptor.count = count;
  descriptor.root = root;
  run_collective(descriptor, [&](const OpDescriptor& d) {
    chain_reduce(*ring_, d, sendbuf, rank() == root ? recvbuf : nullptr);
  });
}

// ---- point to point -----------------------------------------------------------------------------

namespace {

void check_point_to_point(const char* call, const void* buffer, uint64_t count, DataType dtype,
                          int peer, int tag, int rank, int size) {
  check_dtype(dtype, call);
  if (peer < 0 || peer >= size) {
    throw invalid(
        fmt::format("{}: peer {} is not a rank of this communicator (size {})", call, peer, size));
  }
  if (peer == rank) {
    throw invalid(
        fmt::format("{}: rank {} cannot {} itself (the call blocks until the other "
                    "side has matched it)",
                    call, rank, call == std::string_view("send") ? "send to" : "receive from"));
  }
  if (tag < 0) throw invalid(fmt::format("{}: tag {} is negative", call, tag));
  if (buffer == nullptr && count > 0) {
    throw invalid(fmt::format("{}: buf is NULL but count is {} (rank {})", call, count, rank));
  }
  if (count > kMaxBufferBytes / dtype_size(dtype)) {
    throw invalid(fmt::format("{}: count {} of {} is too large", call, count, dtype_name(dtype)));
  }
}

}  // namespace

void Communicator::send(const void* buffer, uint64_t count, DataType dtype, int peer, int tag) {
  check_point_to_point("send", buffer, count, dtype, peer, tag, rank(), size());
  OpDescriptor descriptor;
  descriptor.collective = Collective::kSendRecv;
  descriptor.dtype = dtype;
  descriptor.count = count;
  descriptor.root = rank();
  descriptor.detail = static_cast<uint64_t>(tag);
  run_point_to_point(descriptor, [&](const OpDescriptor& d) {
    if (messages_sent_.empty()) messages_sent_.resize(static_cast<size_t>(size()));
    OpDescriptor message = d;
    message.sequence = ++messages_sent_[peer];
    send_to_peer(*ring_, message, buffer, peer);
  });
}

void Communicator::recv(void* buffer, uint64_t count, DataType dtype, int peer, int tag) {
  check_point_to_point("recv", buffer, count, dtype, peer, tag, rank(), size());
  OpDescriptor descriptor;
  descriptor.collective = Collective::kSendRecv;
  descriptor.dtype = dtype;
  descriptor.count = count;
  descriptor.root = peer;
  descriptor.detail = static_cast<uint64_t>(tag);
  run_point_to_point(descriptor, [&](const OpDescriptor& d) {
    if (messages_received_.empty()) messages_received_.resize(static_cast<size_t>(size()));
    OpDescriptor message = d;
    message.sequence = ++messages_received_[peer];
    receive_from_peer(*ring_, message, buffer, peer);
  });
}

}  // namespace kolo
