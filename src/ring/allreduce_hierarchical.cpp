// Hierarchical allreduce across hosts: through one leader per host for small buffers (or where
// hosts hold different numbers of ranks), by shards for large ones.
//
// THROUGH THE LEADERS
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
// transport (a broken rank tells every peer), so nobody waits out the timeout. A rank that runs
// another collective altogether (a broadcast, say) talks to its ring neighbours, whom this
// schedule may never read from: the transports judge such a message when it arrives before any
// receive for it (check_unexpected_frame, transport/framing.hpp), so that is KOLO_ERR_MISMATCH
// too, not a timeout (test fault_mismatch_hierarchical, its "collective" section).
//
// In place. A member posts its receive only once its send completed: the result could not arrive
// sooner anyway (the leader waits for every input), and the transport is then done with the
// buffer. A leader reads its input before it writes its output.
//
// BY SHARDS (Horovod's hierarchical allreduce, NCCL's tree between nodes in spirit)
//
// Every host holds L ranks; local index j is a rank's place among its host's ranks. The buffer is
// cut into L shards, as equal as possible (the first count % L one element more).
//
//   inside    the ranks of each host reduce-scatter the buffer over their ring (Ring::local()),
//             as partials: rank j ends with shard j of its host's sum;
//   between   the ranks of local index j on every host allreduce shard j over their ring
//             (Ring::cross()): L rings at once, each on its own connections, so each host's
//             link carries L flows of 1/L of the buffer;
//   finish    each rank finishes its shard once (AVG's division by N, the postscale, the
//             rounding) into its place in the output;
//   inside    and the host's ranks allgather the finished shards over their ring.
//
// Cost. Each host link carries 2(H-1)/H of the buffer each way where the flat ring's carries
// 2(N-1)/N (one ring edge per direction, numbered host by host): at 4 hosts x 2, 1.5 S against
// 1.75 S, so the model expects 1.17 x the flat ring's busbw where the link is what limits. Inside a
// host the reduce-scatter and the allgather move (L-1)/L of the buffer each, over kolo's
// shared-memory rings. Between hosts, small shards take recursive doubling, as the flat choice
// would for H ranks.
//
// Same result on every rank, every run: element e of shard j is combined inside each host by that
// host's reduce-scatter (the same schedule on every host), between hosts by ring j's allreduce
// (which gives all its members the same bits), finished once by the rank that holds it and copied
// to the others. The order of additions differs from the flat ring's and from the leaders', so
// float results may differ from theirs in the last bits; integer results are bitwise the same.
// Partials travel in the accumulator type with AVG as SUM and no scale factors, as the leaders'
// do; so that ranks whose calls differ in dtype, op or scale factors still disagree, every message
// carries a digest of the call's own (OpDescriptor::detail).
//
// In place. The reduce-scatter reads all of this rank's input before this rank writes any output
// (its shard is finished after it returns), and the allgather only writes.
#include <algorithm>
#include <bit>
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

// A digest of what the partials' descriptor leaves out: the call's dtype, op and scale factors.
uint64_t call_digest(const OpDescriptor& op) {
  const uint64_t fields[] = {static_cast<uint64_t>(op.dtype), static_cast<uint64_t>(op.op),
                             std::bit_cast<uint64_t>(op.prescale),
                             std::bit_cast<uint64_t>(op.postscale)};
  return hash_counts(fields);
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

namespace kolo {

void sharded_hierarchical_allreduce(Ring& ring, const OpDescriptor& op, const void* sendbuf,
                                    void* recvbuf) {
  const ReducingCall call(ring, op, sendbuf, recvbuf, op.count);
  if (call.finished) return;
  ring.begin();
  Ring& local = ring.local();
  Ring& cross = ring.cross();
  const int shard_count = local.size();
  const int j = local.rank();
  std::vector<uint64_t> counts(static_cast<size_t>(shard_count), op.count / shard_count);
  for (uint64_t i = 0; i < op.count % shard_count; ++i) ++counts[i];
  const Blocks shards = Blocks::from_counts(counts);
  const uint64_t mine = shards.counts[j];
  const size_t element = dtype_size(op.dtype);
  const size_t accumulator = accumulator_size(op.dtype);

  OpDescriptor partials = op;
  partials.dtype = accumulator_type(op.dtype);
  partials.op = op.op == ReduceOp::kAvg ? ReduceOp::kSum : op.op;
  partials.prescale = 1.0;
  partials.postscale = 1.0;
  partials.detail = call_digest(op);

  // Inside the host: shard j of the host's partial sum, from the input as it is where it needs
  // neither converting nor prescaling.
  const std::byte* input = call.input;
  if (accumulator != element || op.prescale != 1.0) {
    std::byte* loaded = ring.buffer(Ring::kPartials, std::max<size_t>(1, op.count * accumulator));
    reduce_load(loaded, call.input, op.count, call.spec);
    input = loaded;
  }
  std::byte* shard = ring.buffer(Ring::kScratch, std::max<size_t>(1, mine * accumulator));
  ring_reduce_scatter(local, partials, input, shard, shards);
  ring.made_progress();

  // Between the hosts: shard j over the ring of local index j.
  if (cross.size() > 1) {
    partials.count = mine;
    if (flat_allreduce_algorithm(mine * accumulator, cross.size()) ==
        Algorithm::kRecursiveDoubling) {
      recursive_doubling_allreduce(cross, partials, shard, shard);
    } else {
      ring_allreduce(cross, partials, shard, shard);
    }
    ring.made_progress();
  }

  // Finish this rank's shard once, then gather the host's shards.
  std::byte* identity = ring.buffer(Ring::kReceiveSlots, std::max<size_t>(1, mine * element));
  fill_identity(identity, mine, op.dtype, op.op);
  const ReduceSpec finish_spec{op.dtype, op.op, 1.0, op.postscale, ring.size()};
  std::byte* finished = call.output + shards.offsets[j] * element;
  reduce_finish(finished, shard, identity, mine, finish_spec);
  OpDescriptor gathered = op;
  gathered.detail = partials.detail;
  ring_allgather(local, gathered, finished, call.output, shards);
  ring.made_progress();
}

}  // namespace kolo
