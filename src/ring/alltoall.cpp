// Alltoall(v): pairwise exchange over the full mesh of connections.
//
// Rank r holds one block for every rank p (layout.send_counts[p] elements at send_offsets[p] of
// sendbuf) and receives one block from every rank p (recv_counts[p] elements at recv_offsets[p]
// of recvbuf). Its own block is a local copy; the others go in N-1 steps:
//
//   step s = 1 .. N-1: rank r sends its block for r+s and receives the block of r-s (mod N).
//
// Each pair of ranks exchanges exactly one message each way per call, so the order in which the
// messages between two ranks are matched cannot be confused. Every receive is posted first, then
// every send in step order, and all of them progress at once: each rank uses all its links, and
// the step order means that at any moment the ranks are mostly talking to different peers. Cost:
// (N-1)·a + (N-1)/N · S/B for equal blocks (S the bytes each rank sends), which no schedule beats
// on a mesh; nothing is reduced and nothing pipelined, since every block goes straight from the
// sender's buffer into its place in the receiver's.
//
// sendbuf and recvbuf may overlap (in place is sendbuf == recvbuf): then the blocks to send are
// first copied into a scratch buffer, since a block arriving could otherwise overwrite one not yet
// sent. This copy is the only one besides the rank's own block.
//
// Agreement. A message carries the call's descriptor; for alltoallv its count is that pair's count
// (the sender's send count, checked against the receiver's receive count) and detail is 1. In an
// alltoall every rank receives from every other, so a rank that disagrees is found out by all. In
// an alltoallv two ranks may disagree about their pair's counts while the others have nothing to
// object to, so the call ends with an agreement round (ring_agree, (N-1)·a more): a rank finishes
// it only after every rank has finished its exchanges without error.
#include <algorithm>
#include <cstring>

#include "ring/ring.hpp"

namespace kolo {
namespace {

// [begin, end) in elements, over the non-empty blocks; begin == end when all are empty.
struct Extent {
  uint64_t begin = ~uint64_t{0};
  uint64_t end = 0;
  bool empty() const { return begin >= end; }
};

Extent extent_of(const std::vector<uint64_t>& counts, const std::vector<uint64_t>& offsets) {
  Extent extent;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] == 0) continue;
    extent.begin = std::min(extent.begin, offsets[p]);
    extent.end = std::max(extent.end, offsets[p] + counts[p]);
  }
  return extent;
}

}  // namespace

void pairwise_alltoall(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                       const AlltoallLayout& layout) {
  const int n = ring.size();
  const int r = ring.rank();
  const bool per_pair_counts = op.collective == Collective::kAlltoallv;
  const size_t element = dtype_size(op.dtype);
  auto* output = static_cast<std::byte*>(recvbuf);

  // Where the block for peer p is read from: sendbuf, or its copy in scratch.
  const Extent sent = extent_of(layout.send_counts, layout.send_offsets);
  const Extent received = extent_of(layout.recv_counts, layout.recv_offsets);
  const auto* send_base = static_cast<const std::byte*>(sendbuf);
  const std::byte* staged = nullptr;
  if (!sent.empty() && !received.empty()) {
    const std::byte* send_begin = send_base + sent.begin * element;
    const std::byte* send_end = send_base + sent.end * element;
    const std::byte* receive_begin = output + received.begin * element;
    const std::byte* receive_end = output + received.end * element;
    if (send_begin < receive_end && receive_begin < send_end) {
      std::byte* scratch = ring.buffer(Ring::kScratch, (sent.end - sent.begin) * element);
      std::memcpy(scratch, send_begin, (sent.end - sent.begin) * element);
      staged = scratch;
    }
  }
  auto block_for = [&](int peer) {
    const uint64_t offset = layout.send_offsets[peer];
    return const_cast<std::byte*>(staged ? staged + (offset - sent.begin) * element
                                         : send_base + offset * element);
  };
  auto copy_own = [&] {
    if (layout.recv_counts[r] > 0) {
      std::memcpy(output + layout.recv_offsets[r] * element, block_for(r),
                  layout.recv_counts[r] * element);
    }
  };
  if (n == 1) {
    copy_own();
    return;
  }

  Transfer* transfers = ring.transfers(2 * static_cast<size_t>(n - 1));
  Transfer* receives = transfers;
  Transfer* sends = transfers + (n - 1);
  ring.begin();
  for (int s = 1; s < n; ++s) {
    const int from = (r - s + n) % n;
    OpDescriptor expected = op;
    if (per_pair_counts) {
      expected.count = layout.recv_counts[from];
      expected.detail = 1;
    }
    receives[s - 1].reset(from, expected, output + layout.recv_offsets[from] * element,
                          layout.recv_counts[from] * element);
    ring.transport().post_recv(receives[s - 1]);
  }
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n;
    OpDescriptor message = op;
    if (per_pair_counts) {
      message.count = layout.send_counts[to];
      message.detail = 1;
    }
    sends[s - 1].reset(to, message, block_for(to), layout.send_counts[to] * element);
    ring.transport().post_send(sends[s - 1]);
  }
  copy_own();
  for (int s = 1; s < n; ++s) {
    while (!receives[s - 1].complete) ring.wait(op, (r - s + n) % n);
    ring.made_progress();
  }
  for (int s = 1; s < n; ++s) {
    while (!sends[s - 1].complete) ring.wait(op, (r + s) % n);
    ring.made_progress();
  }
  if (per_pair_counts) ring_agree(ring, op);
}

}  // namespace kolo
