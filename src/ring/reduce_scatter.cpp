// Ring reduce-scatter: the first half of the ring allreduce, ending with each rank's own block.
//
// sendbuf holds every rank's block in rank order (rank b's block: blocks.counts[b] elements at
// blocks.offsets[b]; equal for reduce-scatter, the caller's counts for reduce-scatterv), and rank
// r ends with block r of the reduction in recvbuf. Rank r sends to r+1 and receives from r-1:
//
//   step s = 0 .. N-2: rank r sends block (r - 1 - s) and receives block (r - 2 - s), which it
//   combines with its own contribution to that block.
//
// At step 0 the block sent is the rank's own contribution; at each later step the partial it
// combined at the step before (block r-1-s was received at step s-1). The partial of block b
// starts at rank b+1 and gathers one contribution per hop; at the last step (s = N-2) rank r
// receives block r with N-1 contributions, adds its own and finishes it into recvbuf: AVG's
// division, the postscale and the rounding of half types happen there, once.
//
// Each rank sends N-1 blocks, (N-1)/N of the input S for equal blocks: the time is
// (N-1)·a + (N-1)/N · S/B plus the reduction, the lower bound of the bandwidth term.
//
// Pipelining, memory and arithmetic as in allreduce.cpp: segments of KOLO_SEGMENT_BYTES, all
// messages in one global order, a send posted as soon as the receive it depends on has been
// combined; receives land in a few reusable slots (or are reduced straight out of a transport's
// shared memory), partials are kept in the accumulator type
// (float32 for the half types) in a reusable shadow of the input (the input is never written), and
// the first send goes straight from sendbuf unless it needs converting or prescaling. In place
// (recvbuf is this rank's block of sendbuf) the finish reads the own contribution of each element
// just before it writes the result there, which the kernels allow.
//
// Every block has at least one segment, so every rank receives at every step; the partial of any
// block but rank r's own passes the link from r to r+1, where a disagreeing rank r is caught: no
// rank can finish while another reports KOLO_ERR_MISMATCH.
#include <algorithm>

#include "ring/reducing_call.hpp"
#include "ring/ring.hpp"

namespace kolo {
namespace {

enum class Action : uint8_t {
  kSendInput,    // step 0: our own contribution, loaded if needed
  kSendPartial,  // a partial we combined
  kCombine,      // receive: combine into our partial of that block
  kFinish,       // last receive: finish our own block into recvbuf
};

struct Step {
  Action action;
  uint64_t begin;   // element offset in sendbuf
  uint64_t length;  // elements
  size_t depends_on;
};
constexpr size_t kNone = ~size_t{0};
constexpr size_t kReceiveSlots = 4;

}  // namespace

void ring_reduce_scatter(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                         const Blocks& blocks) {
  const int n = ring.size();
  const int r = ring.rank();
  const ReducingCall call(ring, op, sendbuf, recvbuf, blocks.counts[0]);
  if (call.finished) return;

  const size_t element = dtype_size(op.dtype);
  const size_t accumulator = accumulator_size(op.dtype);
  const uint64_t segment =
      std::max<size_t>(1, ring.segment_for(blocks.total / n * accumulator) / accumulator);
  const bool send_input_directly = accumulator == element && op.prescale == 1.0;
  std::byte* partials =
      ring.buffer(Ring::kPartials, std::max<uint64_t>(1, blocks.total) * accumulator);
  std::byte* slots = ring.buffer(Ring::kReceiveSlots, kReceiveSlots * segment * accumulator);
  auto mod = [n](int value) { return ((value % n) + n) % n; };
  auto segments = [&](int block) {
    return std::max<uint64_t>(1, (blocks.counts[block] + segment - 1) / segment);
  };
  auto step = [&](Action action, int block, uint64_t k, size_t depends_on) {
    const uint64_t offset = std::min(k * segment, blocks.counts[block]);
    return Step{action, blocks.offsets[block] + offset,
                std::min(segment, blocks.counts[block] - offset), depends_on};
  };

  std::vector<Step> sends;
  std::vector<Step> receives;
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = mod(r - 1 - s);
    const int receive_block = mod(r - 2 - s);
    const size_t first = s == 0 ? kNone : receives.size() - segments(send_block);
    for (uint64_t k = 0; k < segments(send_block); ++k) {
      sends.push_back(step(s == 0 ? Action::kSendInput : Action::kSendPartial, send_block, k,
                           s == 0 ? kNone : first + k));
    }
    for (uint64_t k = 0; k < segments(receive_block); ++k) {
      receives.push_back(
          step(s == n - 2 ? Action::kFinish : Action::kCombine, receive_block, k, kNone));
    }
  }

  Transfer* transfers = ring.transfers(sends.size() + receives.size());
  Transfer* send_transfers = transfers;
  Transfer* receive_transfers = transfers + sends.size();
  std::vector<IncomingReduction> reductions(receives.size());
  std::vector<size_t> slot_of(receives.size(), kNone);
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

    while (posted_receives < receives.size() && !free_slots.empty()) {
      const size_t slot = free_slots.back();
      free_slots.pop_back();
      slot_of[posted_receives] = slot;
      Transfer& transfer = receive_transfers[posted_receives];
      const Step& step = receives[posted_receives];
      transfer.reset(ring.left(), op, slots + slot * segment * accumulator,
                     step.length * accumulator);
      const bool finish = step.action == Action::kFinish;
      reductions[posted_receives] = {&call.spec, finish,
                                     finish
                                         ? call.output + (step.begin - blocks.offsets[r]) * element
                                         : partials + step.begin * accumulator,
                                     call.input + step.begin * element};
      reductions[posted_receives].attach(transfer);
      ring.transport().post_recv(transfer);
      ++posted_receives;
      moved = true;
    }

    while (processed_receives < posted_receives && receive_transfers[processed_receives].complete) {
      reductions[processed_receives].complete(receive_transfers[processed_receives]);
      free_slots.push_back(slot_of[processed_receives]);
      ++processed_receives;
      moved = true;
    }

    while (posted_sends < sends.size() && (sends[posted_sends].depends_on == kNone ||
                                           sends[posted_sends].depends_on < processed_receives)) {
      const Step& step = sends[posted_sends];
      Transfer& transfer = send_transfers[posted_sends];
      if (step.action == Action::kSendInput && send_input_directly) {
        transfer.reset(ring.right(), op, const_cast<std::byte*>(call.input + step.begin * element),
                       step.length * element);
      } else {
        if (step.action == Action::kSendInput) {
          reduce_load(partials + step.begin * accumulator, call.input + step.begin * element,
                      step.length, call.spec);
        }
        transfer.reset(ring.right(), op, partials + step.begin * accumulator,
                       step.length * accumulator);
      }
      ring.transport().post_send(transfer);
      ++posted_sends;
      moved = true;
    }

    while (completed_sends < posted_sends && send_transfers[completed_sends].complete) {
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
