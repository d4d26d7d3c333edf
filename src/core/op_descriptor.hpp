// What one collective call is, as every message of it says on the wire. A receiver compares the
// descriptor of each incoming message with its own; any difference means the ranks disagree.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "kolo/dtype.hpp"

namespace kolo {

enum class Collective : uint8_t {
  kAllreduce = 1,
  kBroadcast = 2,
  kBarrier = 3,
  kAllgather = 4,
  kAllgatherv = 5,
  kReduceScatter = 6,
  kReduceScatterv = 7,
  kAlltoall = 8,
  kAlltoallv = 9,
  kReduce = 10,
  kSendRecv = 11,         // a point-to-point message, from rank `root`
  kSendRecvReceipt = 12,  // its receiver's acknowledgement (see ring/send_recv.cpp)
  kSplit = 13,            // the exchange and the outcome of a communicator split
  kNegotiation = 14,      // a fusion engine's negotiation message (src/fusion/wire.hpp): the
                          // cycle in `sequence`, the message kind expected in `detail`
  kGrow = 15,             // the members' exchange of a communicator growth (comm/grow.cpp)
};

const char* collective_name(Collective collective);

// The schedule of a call, where a collective has more than one: chosen from the message size the
// same way on every rank, and carried so that ranks built or configured differently report a
// mismatch instead of waiting for messages that never come. See src/ring/algorithms.hpp.
enum class Algorithm : uint8_t {
  kRing = 0,                // the ring (or, for alltoall and send/recv, the one schedule)
  kRecursiveDoubling = 1,   // small allreduce
  kBruck = 2,               // small allgather
  kHierarchical = 3,        // allreduce through host leaders (ring/allreduce_hierarchical.cpp)
  kHierarchicalShards = 4,  // large allreduce by shards across hosts (the same file)
  kOneShot = 5,             // small allreduce, recursive doubling's one-shot form (its file)
};

const char* algorithm_name(Algorithm algorithm);

struct OpDescriptor {
  Collective collective = Collective::kAllreduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  Algorithm algorithm = Algorithm::kRing;
  int32_t root = -1;        // -1 for collectives without a root
  uint64_t count = 0;
  uint64_t sequence = 0;    // per-communicator collective number, from 1
  double prescale = 1.0;
  double postscale = 1.0;
  // What else the ranks must agree on: for allgatherv and reduce-scatterv a hash of the per-rank
  // counts; for alltoallv 1 on the messages between two ranks (count is then that pair's count);
  // for send/recv the tag; for a negotiation message its kind. 0 otherwise.
  uint64_t detail = 0;

  bool operator==(const OpDescriptor&) const = default;
};
static_assert(sizeof(OpDescriptor) == 48, "OpDescriptor is sent as it is laid out in memory");
static_assert(std::is_trivially_copyable_v<OpDescriptor>);

// "allreduce #3 (count 10, float32, sum)", with root and scale factors where they matter.
std::string describe(const OpDescriptor& descriptor);

}  // namespace kolo
