// Reduce to a root: a pipelined chain round the ring that ends at the root.
//
// Position p = (rank - root - 1) mod N: the chain starts at the root's right neighbour (p = 0)
// and ends at the root (p = N-1); every rank sends to r+1 and receives from r-1, as in the ring.
// The buffer is cut into segments of KOLO_SEGMENT_BYTES (in the accumulator type), and for each
// segment, in order:
//
//   p = 0       loads its own contribution (prescaled, widened for half types) and sends it;
//   0 < p < N-1 receives the partial, combines its own contribution into it and sends it on;
//   p = N-1     receives the partial, combines its own and finishes it into recvbuf (AVG's
//               division, the postscale and the rounding of half types happen there, once).
//
// Every link carries the buffer once, all at the same time: with many segments the time
// approaches S/B + (N-2)·segment/B + (N-1)·a plus one reduction of S per rank — better than
// reduce-scatter followed by a gather to the root (2(N-1)/N · S/B) for N > 2, and equal at N = 2.
// The chain is what NCCL's ring reduce does too.
//
// Memory. A received segment is combined in its receive slot (straight out of the transport's
// shared memory where it holds the payload there) and sent on from there; the
// slot is reused once that send has completed (a handful of slots in all: the chain needs no
// buffer of the message's size, and recvbuf is only used on the root). The chain has no cycle, so
// waiting for slots cannot deadlock: the root frees its slots as it finishes, which lets its left
// neighbour's sends complete, and so on back to the start.
//
// Agreement. A chain lets the first ranks finish having heard from nobody, so it is preceded by an
// agreement round (ring_agree, (N-1)·a): ranks that disagree on the root, count, dtype or op all
// get KOLO_ERR_MISMATCH, and no buffer is written.
#include <algorithm>

#include "ring/reducing_call.hpp"
#include "ring/ring.hpp"

namespace kolo {
namespace {

constexpr size_t kSlots = 4;
constexpr size_t kNone = ~size_t{0};

}  // namespace

void chain_reduce(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf) {
  const int n = ring.size();
  const ReducingCall call(ring, op, sendbuf, recvbuf, op.count);
  if (call.finished) return;
  ring_agree(ring, op);

  const int position = (ring.rank() - op.root - 1 + 2 * n) % n;
  const bool starts = position == 0;
  const bool is_root = position == n - 1;
  const size_t element = dtype_size(op.dtype);
  const size_t accumulator = accumulator_size(op.dtype);
  const uint64_t segment =
      std::max<size_t>(1, ring.segment_for(op.count * accumulator) / accumulator);
  const uint64_t segments = std::max<uint64_t>(1, (op.count + segment - 1) / segment);
  const bool send_input_directly = accumulator == element && op.prescale == 1.0;
  std::byte* slots = ring.buffer(Ring::kReceiveSlots, kSlots * segment * accumulator);
  auto begin_of = [&](uint64_t k) { return std::min(k * segment, op.count); };
  auto length_of = [&](uint64_t k) { return std::min(segment, op.count - begin_of(k)); };

  // Receives (all but the start) and sends (all but the root), one per segment, in order.
  const uint64_t receive_total = starts ? 0 : segments;
  const uint64_t send_total = is_root ? 0 : segments;
  Transfer* transfers = ring.transfers(2 * segments);
  Transfer* receives = transfers;
  Transfer* sends = transfers + segments;
  std::vector<IncomingReduction> reductions(segments);
  std::vector<size_t> receive_slot(segments, kNone);
  std::vector<size_t> send_slot(segments, kNone);
  std::vector<size_t> free_slots;
  for (size_t slot = 0; slot < kSlots; ++slot) free_slots.push_back(kSlots - 1 - slot);
  auto slot_data = [&](size_t slot) { return slots + slot * segment * accumulator; };

  uint64_t posted_receives = 0;
  uint64_t processed_receives = 0;
  uint64_t posted_sends = 0;
  uint64_t completed_sends = 0;
  ring.begin();
  while (processed_receives < receive_total || completed_sends < send_total) {
    bool moved = false;

    if (starts) {
      // Our own contribution, from sendbuf or loaded into a slot.
      while (posted_sends < send_total && (send_input_directly || !free_slots.empty())) {
        const uint64_t k = posted_sends;
        if (send_input_directly) {
          sends[k].reset(ring.right(), op,
                         const_cast<std::byte*>(call.input + begin_of(k) * element),
                         length_of(k) * element);
        } else {
          send_slot[k] = free_slots.back();
          free_slots.pop_back();
          reduce_load(slot_data(send_slot[k]), call.input + begin_of(k) * element, length_of(k),
                      call.spec);
          sends[k].reset(ring.right(), op, slot_data(send_slot[k]), length_of(k) * accumulator);
        }
        ring.transport().post_send(sends[k]);
        ++posted_sends;
        moved = true;
      }
    } else {
      while (posted_receives < receive_total && !free_slots.empty()) {
        const uint64_t k = posted_receives;
        receive_slot[k] = free_slots.back();
        free_slots.pop_back();
        receives[k].reset(ring.left(), op, slot_data(receive_slot[k]), length_of(k) * accumulator);
        // The root finishes into the output; every other rank combines in the slot and sends
        // the partial on from there.
        reductions[k] = {&call.spec, is_root,
                         is_root ? call.output + begin_of(k) * element : slot_data(receive_slot[k]),
                         call.input + begin_of(k) * element};
        reductions[k].attach(receives[k]);
        ring.transport().post_recv(receives[k]);
        ++posted_receives;
        moved = true;
      }
      while (processed_receives < posted_receives && receives[processed_receives].complete) {
        const uint64_t k = processed_receives;
        std::byte* partial = slot_data(receive_slot[k]);
        reductions[k].complete(receives[k]);
        if (is_root) {
          free_slots.push_back(receive_slot[k]);
        } else {
          send_slot[k] = receive_slot[k];  // sent on from the same slot, freed when sent
          sends[k].reset(ring.right(), op, partial, length_of(k) * accumulator);
          ring.transport().post_send(sends[k]);
          ++posted_sends;
        }
        ++processed_receives;
        moved = true;
      }
    }

    while (completed_sends < posted_sends && sends[completed_sends].complete) {
      if (send_slot[completed_sends] != kNone) free_slots.push_back(send_slot[completed_sends]);
      ++completed_sends;
      moved = true;
    }

    if (moved) {
      ring.made_progress();
    } else {
      ring.wait(op, processed_receives < receive_total ? ring.left() : ring.right());
    }
  }
}

}  // namespace kolo
