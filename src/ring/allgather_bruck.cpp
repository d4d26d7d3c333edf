// Bruck's allgather, for small buffers: ceil(log2 N) steps instead of the ring's N-1.
//
// Blocks are laid out as in the ring allgather (allgather.cpp): rank b's block at blocks.offsets[b]
// of recvbuf. Before step k rank r holds the d = 2^k blocks r, r+1, ..., r+d-1 (mod N); at step k
//
//   rank r sends blocks r .. r+m-1 to rank r-d, and receives blocks r+d .. r+d+m-1 from rank r+d,
//   where m = min(d, N-d),
//
// so afterwards it holds r .. r+d+m-1: 2d blocks, or all N at the last step. The blocks of a step
// are consecutive mod N, so they are one contiguous range of recvbuf, or two when the range wraps
// past the last rank: then they travel as two messages, and sender and receiver, which look at the
// same range of block numbers, agree on the split. Nothing is copied but this rank's own block
// into recvbuf (Bruck's final rotation is not needed: every block lands in its place).
//
// Cost: ceil(log2 N)·a + (N-1)/N · S/B for equal blocks: the same bytes as the ring, in fewer and
// larger messages, but without the ring's pipelining, and every step waits for the previous one.
// bench/all_gather_perf measured where it wins (src/ring/algorithms.hpp).
//
// Every step sends and receives at least one message, possibly empty, and the blocks a rank ends
// with reached it through a chain of checked messages; a rank that disagrees is found out by the
// ranks it sends to, which stop, so nobody can collect its block and finish.
#include <algorithm>
#include <cstring>

#include "ring/ring.hpp"

namespace kolo {
namespace {

// A range of consecutive blocks [first, first + count) mod N, as 1 or 2 contiguous byte ranges.
struct Range {
  uint64_t begin = 0;  // elements
  uint64_t length = 0;
};

int split_blocks(const Blocks& blocks, int first, int count, Range out[2]) {
  const int n = blocks.ranks();
  auto span = [&](int from, int to) {  // blocks [from, to), no wrap
    const uint64_t begin = blocks.offsets[from];
    const uint64_t end = blocks.offsets[to - 1] + blocks.counts[to - 1];
    return Range{begin, end - begin};
  };
  if (first + count <= n) {
    out[0] = span(first, first + count);
    return 1;
  }
  out[0] = span(first, n);
  out[1] = span(0, first + count - n);
  return 2;
}

}  // namespace

void bruck_allgather(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                     const Blocks& blocks) {
  const int n = ring.size();
  const int r = ring.rank();
  const size_t element = dtype_size(op.dtype);
  auto* output = static_cast<std::byte*>(recvbuf);
  std::byte* own_in_output = output + blocks.offsets[r] * element;
  if (blocks.counts[r] > 0 && sendbuf != own_in_output) {
    std::memcpy(own_in_output, sendbuf, blocks.counts[r] * element);
  }
  ring.begin();
  for (int distance = 1; distance < n; distance *= 2) {
    const int m = std::min(distance, n - distance);
    const int to = (r - distance + n) % n;
    const int from = (r + distance) % n;
    Range sends[2];
    Range receives[2];
    const int send_count = split_blocks(blocks, r, m, sends);
    const int receive_count = split_blocks(blocks, from, m, receives);
    Transfer* transfers = ring.transfers(static_cast<size_t>(send_count + receive_count));
    for (int i = 0; i < receive_count; ++i) {
      transfers[i].reset(from, op, output + receives[i].begin * element,
                         receives[i].length * element);
      ring.transport().post_recv(transfers[i]);
    }
    for (int i = 0; i < send_count; ++i) {
      Transfer& transfer = transfers[receive_count + i];
      transfer.reset(to, op, output + sends[i].begin * element, sends[i].length * element);
      ring.transport().post_send(transfer);
    }
    for (int i = 0; i < send_count + receive_count; ++i) {
      while (!transfers[i].complete) ring.wait(op, i < receive_count ? from : to);
      ring.made_progress();
    }
  }
}

}  // namespace kolo
