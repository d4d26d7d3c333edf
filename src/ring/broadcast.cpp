// Broadcast: a pipelined chain around the ring, starting at the root.
//
// Position p = (rank - root) mod N. The root (p = 0) sends the buffer to p = 1 in segments of
// KOLO_SEGMENT_BYTES; every other rank receives each segment straight into its buffer and, unless
// it is last in the chain (p = N-1), forwards it at once, so all links carry segments at the same
// time. With many segments the time approaches S/B + (N-2)·segment/B + (N-1)·a, close to one copy
// of the buffer over one link, which is what a large broadcast of initial weights needs.
//
// A chain lets a rank finish having heard only from the ranks before it, so the chain is preceded
// by an agreement round (ring_agree, (N-1)·a): ranks that disagree on the root, count or dtype all
// get KOLO_ERR_MISMATCH, and no buffer is written.
#include <algorithm>

#include "ring/ring.hpp"

namespace kolo {

void ring_broadcast(Ring& ring, const OpDescriptor& op, void* buffer) {
  const int n = ring.size();
  if (n == 1) return;
  const int position = (ring.rank() - op.root + n) % n;
  const uint64_t bytes = op.count * dtype_size(op.dtype);
  const uint64_t segment = std::max<uint64_t>(
      dtype_size(op.dtype), ring.segment_for(bytes) / dtype_size(op.dtype) * dtype_size(op.dtype));
  const uint64_t segments = std::max<uint64_t>(1, (bytes + segment - 1) / segment);
  auto* data = static_cast<std::byte*>(buffer);
  auto piece = [&](uint64_t k, Transfer& transfer, int peer) {
    uint64_t begin = std::min(k * segment, bytes);
    transfer.reset(peer, op, data + begin, std::min(segment, bytes - begin));
  };

  ring_agree(ring, op);
  const bool forwards = position != 0 && position != n - 1;
  Transfer* transfers = ring.transfers(2 * segments);
  Transfer* sends = transfers;
  Transfer* receives = transfers + segments;
  ring.begin();
  if (position == 0) {
    for (uint64_t k = 0; k < segments; ++k) {
      piece(k, sends[k], ring.right());
      ring.transport().post_send(sends[k]);
    }
    for (uint64_t k = 0; k < segments; ++k) {
      while (!sends[k].complete) ring.wait(op, ring.right());
      ring.made_progress();
    }
    return;
  }

  for (uint64_t k = 0; k < segments; ++k) {
    piece(k, receives[k], ring.left());
    ring.transport().post_recv(receives[k]);
  }
  for (uint64_t k = 0; k < segments; ++k) {
    while (!receives[k].complete) ring.wait(op, ring.left());
    ring.made_progress();
    if (forwards) {
      piece(k, sends[k], ring.right());
      ring.transport().post_send(sends[k]);
    }
  }
  for (uint64_t k = 0; forwards && k < segments; ++k) {
    while (!sends[k].complete) ring.wait(op, ring.right());
    ring.made_progress();
  }
}

}  // namespace kolo
