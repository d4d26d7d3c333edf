// Hierarchical allreduce, for small buffers across hosts: through one leader per host.
//
// Each host's leader is its lowest rank (ring/ring.hpp, HostMap; what a host is: core/host.hpp).
// With H hosts and L ranks on the most crowded one:
//
//   gather    every other rank sends its input to its leader, all at once; the leader loads its own
//             input into a partial (accumulator type, prescaled) and combines the members' inputs
//             into it in rank order, whatever order they arrive in;
//   between   the H leaders allreduce their partials over a ring of the leaders only
//             (Ring::leaders(), the same transport): recursive doubling for small partials, the
//             ring for large ones, as flat_allreduce_algorithm() picks for H ranks. The partials
//             are in the accumulator type and combine with SUM for AVG and no scale factors, so
//             that nothing is rounded, divided or scaled before the end;
//   finish    every leader finishes the result into its output (AVG's division by N, the postscale
//             and the rounding of half types, once), as recursive doubling does: combined with the
//             identity of the op, which changes no value;
//   fan-out   and sends it to each of its members, all at once.
//
// Cost. Inside a host two steps, 2·a_intra + 2(L-1)·S/B_intra at the leader (it receives and
// sends L-1 buffers); between the hosts what the leaders' schedule costs for H ranks, for
// recursive doubling (log2 H + 2·[H not a power of two])·(a_inter + S/B_inter). The flat ring pays
// a_inter at each of its 2(N-1) steps; recursive doubling over all N ranks at each of its steps
// that pairs ranks of different hosts, which is only log2 H of them when hosts of 2^k ranks are
// numbered host by host, but up to all of them otherwise (and then with L flows sharing each
// host's link). For large S the leader's 2(L-1)·S inside the host and the whole buffer on every
// leader's link lose to the ring's 2(N-1)/N · S. KOLO_ALLREDUCE=auto therefore runs it only where
// recursive doubling would run, and where some host has several ranks and recursive doubling
// does not cross between hosts in fewer steps (hierarchical_pays() in ring/algorithms.hpp).
//
// Same result on every rank, every run. Every element is reduced by the same expression wherever
// it lies in the buffer and whatever the timing: within a host in rank order; between hosts by
// the leaders' schedule, which itself gives every leader bitwise the same result; then finished
// once by each leader the same way and copied to its members. The expression differs from the
// flat schedules' (another order of additions), so floating-point results may differ from theirs in
// the last bits; integer results, whose operations are associative, are bitwise the same.
//
// Agreement. Every message carries the descriptor with Algorithm::kHierarchical: a member's input
// is checked by its leader, the leaders' partials by each other, the result by each member. The
// leaders' messages carry the accumulator type and SUM for AVG, as they are on the wire; two ranks
// whose calls differ disagree in those too. A member learns of a failure elsewhere through the
// transport (a broken rank tells every peer), so nobody waits out the timeout. Not caught: a rank
// that runs another collective altogether (a broadcast, say) talks to its ring neighbours, whom
// this schedule may never read from; then every rank ends in KOLO_ERR_TIMEOUT after KOLO_TIMEOUT
// instead (seen with the last of 3 + 2 ranks broadcasting), as the flat schedules can too when
// their pairs miss the odd rank.
//
// In place. A member posts its receive only once its send completed: the result could not arrive
// sooner anyway (the leader waits for every input), and the transport is then done with the
// buffer. A leader reads its input before it writes its output.
#include <algorithm>
#include <vector>

#include "ring/reducing_call.hpp"
#include "ring/ring.hpp"

namespace kolo {
namespace {

// Posts one transfer and waits for it.
void send_and_wait(Ring& ring, const OpDescriptor& op, int peer, const void* data, size_t bytes) {
  Transfer* transfer = ring.transfers(1);
  transfer->reset(peer, op, const_cast<void*>(data), bytes);
  ring.transport().post_send(*transfer);
  while (!transfer->complete) ring.wait(op, peer);
  ring.made_progress();
}

void receive_and_wait(Ring& ring, const OpDescriptor& op, int peer, void* data, size_t bytes) {
  Transfer* transfer = ring.transfers(1);
  transfer->reset(peer, op, data, bytes);
  ring.transport().post_recv(*transfer);
  while (!transfer->complete) ring.wait(op, peer);
  ring.made_progress();
}

}  // namespace

void hierarchical_allreduce(Ring& ring, const OpDescriptor& op, const void* sendbuf,
                            void* recvbuf) {
  const int n = ring.size();
  const int r = ring.rank();
  const ReducingCall call(ring, op, sendbuf, recvbuf, op.count);
  if (call.finished) return;
  const HostMap& hosts = ring.hosts();
  const int leader = hosts.leader_of(r);
  const size_t element = dtype_size(op.dtype);
  const size_t accumulator = accumulator_size(op.dtype);
  const size_t bytes = op.count * element;
  ring.begin();

  if (r != leader) {
    send_and_wait(ring, op, leader, call.input, bytes);
    receive_and_wait(ring, op, leader, call.output, bytes);
    return;
  }

  // Gather: every member's input into a slot of its own, combined in rank order.
  std::vector<int> members;
  for (int rank = 0; rank < n; ++rank) {
    if (rank != r && hosts.leader_of(rank) == r) members.push_back(rank);
  }
  std::byte* partial = ring.buffer(Ring::kPartials, std::max<size_t>(1, op.count * accumulator));
  std::byte* inputs = ring.buffer(Ring::kReceiveSlots, std::max<size_t>(1, members.size() * bytes));
  Transfer* transfers = ring.transfers(members.size());
  for (size_t m = 0; m < members.size(); ++m) {
    transfers[m].reset(members[m], op, inputs + m * bytes, bytes);
    ring.transport().post_recv(transfers[m]);
  }
  reduce_load(partial, call.input, op.count, call.spec);
  for (size_t m = 0; m < members.size(); ++m) {
    while (!transfers[m].complete) ring.wait(op, members[m]);
    ring.made_progress();
    reduce_combine(partial, partial, inputs + m * bytes, op.count, call.spec);
  }

  // Between the hosts: the leaders allreduce their partials, as partials.
  Ring& leaders = ring.leaders();
  if (leaders.size() > 1) {
    OpDescriptor between = op;
    between.dtype = accumulator_type(op.dtype);
    between.op = op.op == ReduceOp::kAvg ? ReduceOp::kSum : op.op;
    between.prescale = 1.0;
    between.postscale = 1.0;
    if (flat_allreduce_algorithm(op.count * accumulator, leaders.size()) ==
        Algorithm::kRecursiveDoubling) {
      recursive_doubling_allreduce(leaders, between, partial, partial);
    } else {
      ring_allreduce(leaders, between, partial, partial);
    }
    ring.made_progress();
  }

  // Finish once, then fan out.
  std::byte* identity = ring.buffer(Ring::kScratch, std::max<size_t>(1, bytes));
  fill_identity(identity, op.count, op.dtype, op.op);
  const ReduceSpec finish_spec{op.dtype, op.op, 1.0, op.postscale, n};
  reduce_finish(call.output, partial, identity, op.count, finish_spec);
  transfers = ring.transfers(members.size());
  for (size_t m = 0; m < members.size(); ++m) {
    transfers[m].reset(members[m], op, call.output, bytes);
    ring.transport().post_send(transfers[m]);
  }
  for (size_t m = 0; m < members.size(); ++m) {
    while (!transfers[m].complete) ring.wait(op, members[m]);
    ring.made_progress();
  }
}

}  // namespace kolo
