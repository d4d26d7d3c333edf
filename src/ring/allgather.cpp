// Ring allgather: every rank's block travels once round the ring.
//
// The output holds every rank's block in rank order: rank b's block is blocks.counts[b] elements
// at blocks.offsets[b] (equal counts for allgather, the caller's counts for allgatherv). Rank r
// sends to r+1 and receives from r-1 (mod N):
//
//   step s = 0 .. N-2: rank r sends block (r - s) and receives block (r - s - 1).
//
// At step 0 it sends its own block, from sendbuf; at every later step the block it received at
// the step before, from where it landed in recvbuf. After N-1 steps every rank holds every block.
//
// Each rank sends N-1 blocks, (N-1)/N of the output S for equal blocks: the time is
// (N-1)·a + (N-1)/N · S/B, the lower bound of the bandwidth term. With uneven blocks each step
// takes as long as its largest block, so a very large block costs (N-1)·a + (N-1)·max/B.
//
// Pipelining, as in allreduce.cpp: every block is cut into segments of KOLO_SEGMENT_BYTES and each
// segment is a message. Every receive is posted at once (each lands in its own place of recvbuf)
// and the send of a segment is posted as soon as its receive has completed, so segment k goes on
// to the right while segment k+1 arrives from the left. Nothing is copied but this rank's own
// block, from sendbuf into recvbuf (not at all in place, where sendbuf is already that block),
// and that copy runs while the first segments are on the wire.
//
// Every block has at least one segment, possibly empty, so every rank receives at every step.
// Ranks that disagree (on the call, the count, or allgatherv's counts, whose hash the descriptor
// carries) all fail: a rank finishes only once every block has come round, and the block of a
// rank that disagrees must first pass that rank's right neighbour, which checks it and stops.
#include <algorithm>
#include <cstring>

#include "ring/ring.hpp"

namespace kolo {
namespace {

// Elements [begin, begin + length) of recvbuf; a send may depend on a receive.
struct Piece {
  uint64_t begin = 0;
  uint64_t length = 0;
  size_t depends_on = 0;
};
constexpr size_t kNone = ~size_t{0};

}  // namespace

void ring_allgather(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                    const Blocks& blocks) {
  const int n = ring.size();
  const int r = ring.rank();
  const size_t element = dtype_size(op.dtype);
  auto* output = static_cast<std::byte*>(recvbuf);
  auto* own = static_cast<std::byte*>(const_cast<void*>(sendbuf));
  std::byte* own_in_output = output + blocks.offsets[r] * element;
  auto copy_own = [&] {
    if (blocks.counts[r] > 0 && own != own_in_output) {
      std::memcpy(own_in_output, own, blocks.counts[r] * element);
    }
  };
  if (n == 1) {
    copy_own();
    return;
  }

  const uint64_t segment =
      std::max<uint64_t>(1, ring.segment_for(blocks.total / n * element) / element);
  auto segments = [&](int block) {
    return std::max<uint64_t>(1, (blocks.counts[block] + segment - 1) / segment);
  };
  auto piece = [&](int block, uint64_t k, size_t depends_on) {
    const uint64_t offset = std::min(k * segment, blocks.counts[block]);
    return Piece{blocks.offsets[block] + offset, std::min(segment, blocks.counts[block] - offset),
                 depends_on};
  };
  auto mod = [n](int value) { return ((value % n) + n) % n; };

  std::vector<Piece> sends;
  std::vector<Piece> receives;
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = mod(r - s);
    const int receive_block = mod(r - s - 1);
    // The block sent at step s > 0 was received at step s-1: same block, same segments.
    const size_t first = s == 0 ? kNone : receives.size() - segments(send_block);
    for (uint64_t k = 0; k < segments(send_block); ++k) {
      sends.push_back(piece(send_block, k, s == 0 ? kNone : first + k));
    }
    for (uint64_t k = 0; k < segments(receive_block); ++k) {
      receives.push_back(piece(receive_block, k, kNone));
    }
  }

  Transfer* transfers = ring.transfers(sends.size() + receives.size());
  Transfer* send_transfers = transfers;
  Transfer* receive_transfers = transfers + sends.size();
  ring.begin();
  for (size_t i = 0; i < receives.size(); ++i) {
    receive_transfers[i].reset(ring.left(), op, output + receives[i].begin * element,
                               receives[i].length * element);
    ring.transport().post_recv(receive_transfers[i]);
  }

  bool copied = false;
  size_t completed_receives = 0;
  size_t posted_sends = 0;
  size_t completed_sends = 0;
  while (completed_receives < receives.size() || completed_sends < sends.size()) {
    bool moved = false;
    while (posted_sends < sends.size() && (sends[posted_sends].depends_on == kNone ||
                                           sends[posted_sends].depends_on < completed_receives)) {
      const Piece& step = sends[posted_sends];
      std::byte* data = step.depends_on == kNone ? own + (step.begin - blocks.offsets[r]) * element
                                                 : output + step.begin * element;
      send_transfers[posted_sends].reset(ring.right(), op, data, step.length * element);
      ring.transport().post_send(send_transfers[posted_sends]);
      ++posted_sends;
      moved = true;
    }
    if (!copied) {
      copy_own();
      copied = true;
    }
    // Receives complete in order per stream; with several streams a later one may finish first,
    // so only the completed prefix counts.
    while (completed_receives < receives.size() && receive_transfers[completed_receives].complete) {
      ++completed_receives;
      moved = true;
    }
    while (completed_sends < posted_sends && send_transfers[completed_sends].complete) {
      ++completed_sends;
      moved = true;
    }
    if (moved) {
      ring.made_progress();
    } else {
      ring.wait(op, completed_receives < receives.size() ? ring.left() : ring.right());
    }
  }
}

}  // namespace kolo
