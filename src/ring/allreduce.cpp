// Ring allreduce (Patarasuk and Yuan): reduce-scatter, then allgather.
//
// The buffer of `count` elements is cut into N chunks, as equal as possible (the first count % N
// chunks hold one element more). Rank r talks only to its neighbours: it sends to r+1 and receives
// from r-1 (mod N).
//
//   Reduce-scatter, steps s = 0 .. N-2: rank r sends chunk (r - s) and receives chunk (r - s - 1),
//   which it combines with its own contribution. The partial result of a chunk thus travels round
//   the ring gathering one contribution per hop; at the last step rank r finishes chunk (r + 1):
//   it holds the reduction of all N contributions.
//
//   Allgather, steps s = 0 .. N-2: rank r sends chunk (r + 1 - s) and receives chunk (r - s),
//   straight into the output, so the finished chunks travel round the ring once more.
//
// Each rank sends 2(N-1) chunks, 2(N-1)/N of the buffer: with latency a and bandwidth B the time
// is 2(N-1)·a + 2(N-1)/N · S/B, which no algorithm beats in the bandwidth term.
//
// Pipelining. Every chunk is cut into segments of KOLO_SEGMENT_BYTES and each segment is a
// message. All receives and sends are posted in one global order, (phase, step, segment), the same
// on every rank, and a send is posted as soon as the receive it depends on has been processed:
// while segment k of one step is on the wire, segment k-1 is being reduced. Reduce-scatter
// receives land in a few reusable slots, or, where the transport holds the payload in shared
// memory, are reduced straight out of it (IncomingReduction, Transfer::sink), one copy fewer;
// everything else moves between the caller's buffers with no copy of ours. Because every rank
// posts receive j before it can wait for send j, and send j depends only on receives before j,
// the pipeline cannot deadlock.
//
// Partials in slots. A partial that is only sent on (every reduce-scatter step but the last) is
// combined into the slot its segment arrived in, and sent from there; the slot is free again once
// that send completes. The segment thus stays in a buffer of a few segments, warm in the cache,
// from its arrival through the reduction to the send, instead of being written to the caller's
// output and read back from it, which are cold for a large buffer. Where the ranks share the
// cores, their CPU time per byte sets the rate (docs/performance.md, "Large buffers over TCP",
// has the measurement). A receive keeps its slot only while another slot stays free; when one
// is left, the partial goes to its usual place and the slot is free once reduced, as before.
// That last slot never waits for a send, so the argument above still holds.
//
// Where partial results live. A partial is kept in the accumulator type (float32 for the half
// types, so they round once, at the end). When that is the element type, the partial of chunk c is
// kept in the caller's output at chunk c (overwritten by the allgather later); otherwise in a
// reusable float32 shadow of the buffer. The first send of each rank goes straight from the input
// unless it needs converting or prescaling.
//
// Every chunk has at least one segment, possibly empty, so every rank receives from its left
// neighbour at every step: ranks that disagree about the call always find out, even for count 0.
//
// Several buffers at once (ring_allreduce_pieces(), which the fusion engine runs for a response's
// large tensors). Chunk c of the collective is chunk c of each piece, cut as that piece alone
// would be, one after the other; segments never cross from one piece into the next. Every element
// is thus reduced at the same ranks in the same order as when its buffer is reduced alone (bitwise
// the same result), while the pieces share one pipeline: the ring synchronises 2(N-1) times for
// all of them, not for each, and a piece's first segments are on the wire while the previous
// piece's last ones are reduced.
#include <algorithm>

#include "ring/reducing_call.hpp"
#include "ring/ring.hpp"

namespace kolo {
namespace {

// Elements [begin, begin + length) of one piece, one message of the pipeline.
struct Segment {
  size_t piece = 0;
  uint64_t begin = 0;
  uint64_t length = 0;
};

enum class Action : uint8_t {
  kSendInput,    // reduce-scatter step 0: our own contribution, loaded if needed
  kSendPartial,  // reduce-scatter: a partial we combined
  kSendOutput,   // allgather: a finished chunk
  kCombine,      // reduce-scatter receive: combine into our partial
  kFinish,       // last reduce-scatter receive: finish into the output
  kGather,       // allgather receive: straight into the output
};

struct Step {
  Action action;
  Segment segment;
  size_t depends_on;  // sends: index of the receive that must be processed first, or kNone
};
constexpr size_t kNone = ~size_t{0};
constexpr size_t kReceiveSlots = 4;

// Chunk c of the collective is chunk c of every piece, in piece order, each piece cut as the ring
// cuts it alone (the first count % N chunks one element longer), and then into segments of at
// most `segment_elements`. A chunk without elements still has one segment, empty.
std::vector<std::vector<Segment>> cut_chunks(const std::vector<AllreducePiece>& pieces, int ranks,
                                             uint64_t segment_elements) {
  std::vector<std::vector<Segment>> chunks(static_cast<size_t>(ranks));
  for (int c = 0; c < ranks; ++c) {
    std::vector<Segment>& segments = chunks[static_cast<size_t>(c)];
    const uint64_t n = static_cast<uint64_t>(ranks), chunk = static_cast<uint64_t>(c);
    for (size_t p = 0; p < pieces.size(); ++p) {
      const uint64_t count = pieces[p].count;
      const uint64_t begin = chunk * (count / n) + std::min(chunk, count % n);
      const uint64_t size = count / n + (chunk < count % n ? 1 : 0);
      for (uint64_t offset = 0; offset < size; offset += segment_elements) {
        segments.push_back({p, begin + offset, std::min(segment_elements, size - offset)});
      }
    }
    if (segments.empty()) segments.push_back({0, 0, 0});
  }
  return chunks;
}

}  // namespace

void ring_allreduce(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf) {
  ring_allreduce_pieces(ring, op, {{sendbuf, recvbuf, op.count}});
}

void ring_allreduce_pieces(Ring& ring, const OpDescriptor& op,
                           const std::vector<AllreducePiece>& pieces) {
  const int n = ring.size();
  const int r = ring.rank();
  if (n == 1) {
    for (const AllreducePiece& piece : pieces) {
      (void)ReducingCall(ring, op, piece.send, piece.recv, piece.count);
    }
    return;
  }
  const ReduceSpec spec{op.dtype, op.op, op.prescale, op.postscale, n};

  const size_t element = dtype_size(op.dtype);
  const size_t accumulator = accumulator_size(op.dtype);
  const uint64_t segment_elements =
      std::max<size_t>(1, ring.segment_for(op.count / n * accumulator) / accumulator);
  const std::vector<std::vector<Segment>> chunks = cut_chunks(pieces, n, segment_elements);
  const bool partials_in_output = accumulator == element;
  const bool send_input_directly = partials_in_output && op.prescale == 1.0;
  // Partials in the accumulator type live in a shadow of every piece, one after the other.
  std::vector<uint64_t> shadow_offset(pieces.size(), 0);
  for (size_t p = 1; p < pieces.size(); ++p) {
    shadow_offset[p] = shadow_offset[p - 1] + pieces[p - 1].count;
  }
  std::byte* shadow =
      partials_in_output
          ? nullptr
          : ring.buffer(Ring::kPartials, std::max<uint64_t>(1, op.count) * accumulator);
  std::byte* slots =
      ring.buffer(Ring::kReceiveSlots, kReceiveSlots * segment_elements * accumulator);
  auto input = [&](const Segment& segment) {
    return static_cast<const std::byte*>(pieces[segment.piece].send) + segment.begin * element;
  };
  auto output = [&](const Segment& segment) {
    return static_cast<std::byte*>(pieces[segment.piece].recv) + segment.begin * element;
  };
  auto partial = [&](const Segment& segment) {
    return partials_in_output
               ? output(segment)
               : shadow + (shadow_offset[segment.piece] + segment.begin) * accumulator;
  };
  auto mod = [n](int value) { return ((value % n) + n) % n; };

  // The schedule, in the global order every rank follows.
  std::vector<Step> sends;
  std::vector<Step> receives;
  for (int s = 0; s < n - 1; ++s) {
    int send_chunk = mod(r - s);
    int receive_chunk = mod(r - s - 1);
    // The partial sent at step s > 0 was received at step s-1: same chunk, same segments.
    const std::vector<Segment>& to_send = chunks[static_cast<size_t>(send_chunk)];
    size_t first = receives.size() - (s == 0 ? 0 : to_send.size());
    for (size_t k = 0; k < to_send.size(); ++k) {
      sends.push_back({s == 0 ? Action::kSendInput : Action::kSendPartial, to_send[k],
                       s == 0 ? kNone : first + k});
    }
    for (const Segment& segment : chunks[static_cast<size_t>(receive_chunk)]) {
      receives.push_back({s == n - 2 ? Action::kFinish : Action::kCombine, segment, kNone});
    }
  }
  for (int s = 0; s < n - 1; ++s) {
    int send_chunk = mod(r + 1 - s);
    int receive_chunk = mod(r - s);
    // Sent at step s: finished by the last reduce-scatter receive, or gathered at step s-1.
    const std::vector<Segment>& to_send = chunks[static_cast<size_t>(send_chunk)];
    size_t first = receives.size() - to_send.size();
    for (size_t k = 0; k < to_send.size(); ++k) {
      sends.push_back({Action::kSendOutput, to_send[k], first + k});
    }
    for (const Segment& segment : chunks[static_cast<size_t>(receive_chunk)]) {
      receives.push_back({Action::kGather, segment, kNone});
    }
  }

  Transfer* transfers = ring.transfers(sends.size() + receives.size());
  Transfer* send_transfers = transfers;
  Transfer* receive_transfers = transfers + sends.size();
  std::vector<IncomingReduction> reductions(receives.size());
  std::vector<size_t> slot_of(receives.size(), kNone);
  std::vector<bool> kept(receives.size(), false);  // the partial stays in the slot (see above)
  std::vector<size_t> slot_of_send(sends.size(), kNone);  // a slot freed when the send completes
  std::vector<size_t> free_slots;
  for (size_t slot = 0; slot < kReceiveSlots; ++slot)
    free_slots.push_back(kReceiveSlots - 1 - slot);

  size_t posted_receives = 0;
  size_t processed_receives = 0;
  size_t posted_sends = 0;
  size_t completed_sends = 0;
  ring.begin();
  while (processed_receives < receives.size() || completed_sends < sends.size()) {
    bool moved = false;

    while (posted_receives < receives.size()) {
      const Step& step = receives[posted_receives];
      Transfer& transfer = receive_transfers[posted_receives];
      if (step.action == Action::kGather) {
        transfer.reset(ring.left(), op, output(step.segment), step.segment.length * element);
      } else {
        if (free_slots.empty()) break;
        size_t slot = free_slots.back();
        free_slots.pop_back();
        slot_of[posted_receives] = slot;
        transfer.reset(ring.left(), op, slots + slot * segment_elements * accumulator,
                       step.segment.length * accumulator);
        const bool finish = step.action == Action::kFinish;
        const bool keep = !finish && !free_slots.empty();
        kept[posted_receives] = keep;
        reductions[posted_receives] = {&spec, finish,
                                       finish ? output(step.segment)
                                       : keep ? static_cast<std::byte*>(transfer.data)
                                              : partial(step.segment),
                                       input(step.segment)};
        reductions[posted_receives].attach(transfer);
      }
      ring.transport().post_recv(transfer);
      ++posted_receives;
      moved = true;
    }

    while (processed_receives < posted_receives && receive_transfers[processed_receives].complete) {
      if (slot_of[processed_receives] != kNone) {
        reductions[processed_receives].complete(receive_transfers[processed_receives]);
        if (!kept[processed_receives]) free_slots.push_back(slot_of[processed_receives]);
      }
      ++processed_receives;
      moved = true;
    }

    while (posted_sends < sends.size() && (sends[posted_sends].depends_on == kNone ||
                                           sends[posted_sends].depends_on < processed_receives)) {
      const Step& step = sends[posted_sends];
      const uint64_t length = step.segment.length;
      Transfer& transfer = send_transfers[posted_sends];
      if (step.action == Action::kSendOutput) {
        transfer.reset(ring.right(), op, output(step.segment), length * element);
      } else if (step.action == Action::kSendInput && send_input_directly) {
        transfer.reset(ring.right(), op, const_cast<std::byte*>(input(step.segment)),
                       length * element);
      } else {
        std::byte* from = partial(step.segment);
        if (step.action == Action::kSendInput) {
          reduce_load(from, input(step.segment), length, spec);
        } else if (kept[step.depends_on]) {
          from = reductions[step.depends_on].result;
          slot_of_send[posted_sends] = slot_of[step.depends_on];
        }
        transfer.reset(ring.right(), op, from, length * accumulator);
      }
      ring.transport().post_send(transfer);
      ++posted_sends;
      moved = true;
    }

    while (completed_sends < posted_sends && send_transfers[completed_sends].complete) {
      if (slot_of_send[completed_sends] != kNone)
        free_slots.push_back(slot_of_send[completed_sends]);
      ++completed_sends;
      moved = true;
    }

    if (moved) {
      ring.made_progress();
    } else {
      ring.wait(op, processed_receives < receives.size() ? ring.left() : ring.right());
    }
  }
}

}  // namespace kolo
