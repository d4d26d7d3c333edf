// Where a collective has more than one schedule, the dispatcher that runs the one chosen: from
// what every rank shares (ring/algorithms.hpp), so that every rank makes the same choice, and
// written into the descriptor every message carries, so that a rank that chose otherwise reports
// a mismatch instead of waiting for messages that never come.
#include "ring/algorithms.hpp"
#include "ring/ring.hpp"

namespace kolo {

void run_allreduce(Ring& ring, OpDescriptor op, const void* sendbuf, void* recvbuf) {
  op.algorithm = allreduce_algorithm(op.count * dtype_size(op.dtype), ring.size(),
                                     ring.allreduce_mode(), ring.hosts().shape());
  if (op.algorithm == Algorithm::kHierarchical) {
    hierarchical_allreduce(ring, op, sendbuf, recvbuf);
  } else if (op.algorithm == Algorithm::kHierarchicalShards) {
    sharded_hierarchical_allreduce(ring, op, sendbuf, recvbuf);
  } else if (op.algorithm == Algorithm::kRecursiveDoubling) {
    recursive_doubling_allreduce(ring, op, sendbuf, recvbuf);
  } else {
    ring_allreduce(ring, op, sendbuf, recvbuf);
  }
}

void allgather_blocks(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                      const Blocks& blocks) {
  if (op.algorithm == Algorithm::kBruck) {
    bruck_allgather(ring, op, sendbuf, recvbuf, blocks);
  } else {
    ring_allgather(ring, op, sendbuf, recvbuf, blocks);
  }
}

}  // namespace kolo
