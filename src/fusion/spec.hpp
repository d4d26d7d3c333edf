// What every rank must agree on about one named submission: the unit of negotiation.
//
// A unit is one named tensor (kolo_allreduce_async, kolo_broadcast_async, kolo_allgather_async) or
// a group of them (kolo_allreduce_group_async), which is negotiated, cached and executed as one. It
// is identified by its key, the name of its first member; every member name is unique among the
// requests that are pending on a rank.
//
// Allgathers are the one kind whose ranks legitimately differ: each rank contributes a count of
// its own and has a receive buffer of its own capacity. A rank submits (and announces) its own
// count as the member's count and its capacity as recv_capacity; rank 0 compares only the rest
// (agreed_part(): kind, dtype, name), gathers the counts in rank order and sends every rank the
// same scheduled spec: the agreed part plus gather_counts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/op_descriptor.hpp"
#include "kolo/dtype.hpp"

namespace kolo::fusion {

// Bounds on what a rank submits and, equally, on what a negotiation message may carry.
inline constexpr size_t kMaxNameBytes = 1024;
inline constexpr size_t kMaxGroupMembers = 4096;

enum class Kind : uint8_t {
  kAllreduce = 1,
  kBroadcast = 2,
  kAllgather = 3,  // one member; counts differ per rank
};

struct Member {
  std::string name;
  uint64_t count = 0;

  bool operator==(const Member&) const = default;
};

struct UnitSpec {
  Kind kind = Kind::kAllreduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;  // kSum for broadcasts
  int32_t root = -1;             // broadcasts only
  double prescale = 1.0;         // allreduces only
  double postscale = 1.0;
  std::vector<Member> members;  // at least one
  // Allgathers only. As submitted: the elements this rank's recvbuf holds (members[0].count is
  // what this rank sends). As scheduled by rank 0: 0, with members[0].count 0 too.
  uint64_t recv_capacity = 0;
  // Allgathers only: every rank's count in rank order as scheduled by rank 0; empty as submitted.
  std::vector<uint64_t> gather_counts;

  const std::string& key() const { return members.front().name; }
  uint64_t total_count() const;
  uint64_t total_bytes() const { return total_count() * dtype_size(dtype); }

  bool operator==(const UnitSpec&) const = default;
};

// "allreduce 'conv1.weight' (count 9408, float32, avg)", or for a group
// "allreduce group 'a' (count 10), 'b' (count 20) (float32, sum, prescale 0.5)". Long groups are
// elided after a few members. Allgathers show what ranks must agree on: "allgather 'ids' (int64)".
std::string describe(const UnitSpec& spec);

// What ranks must agree on: the spec itself, but for an allgather without the per-rank count,
// capacity and gathered counts.
UnitSpec agreed_part(const UnitSpec& spec);

// The sum of gather_counts, or nullopt when its bytes do not fit in 63 bits.
std::optional<uint64_t> gathered_total(const std::vector<uint64_t>& counts, DataType dtype);

// Whether `scheduled` (from rank 0's response) is the unit this rank submitted as `submitted`:
// equal specs, or for an allgather equal agreed parts, gather_counts[rank] equal to this rank's
// count and a gathered total that fits in this rank's recv_capacity.
bool matches_submission(const UnitSpec& submitted, const UnitSpec& scheduled, int rank);

// The schedule the engine reduces an allreduce unit with, alone or fused: recursive doubling when
// the unit's own bytes are within kolo_allreduce's limit for it at this N (flat_allreduce_algorithm
// in ring/algorithms.hpp), else the ring. Recursive doubling combines whole buffers element by
// element, and the fused layout gives every element of a ring-reduced tensor the chunk it has
// alone, so either way a tensor's result does not depend on what it is fused with; and it is
// kolo_allreduce's result too wherever that runs the flat schedules (one host, or
// KOLO_ALLREDUCE=ring).
Algorithm engine_algorithm(const UnitSpec& spec, int ranks);

// Whether a and b may share one fused collective: allreduces of the same dtype, op, factors and
// engine_algorithm().
bool fusable(const UnitSpec& a, const UnitSpec& b, int ranks);

// Checks a spec built from a caller's arguments or read from a peer: known kind, dtype and op,
// finite factors, a root in [0, ranks) for broadcasts, 1..kMaxGroupMembers members with names of
// 1..kMaxNameBytes bytes, distinct, and counts whose byte size fits in 63 bits. Allgathers: one
// member, no root, op and factors at their defaults, a recv_capacity whose bytes fit in 63 bits,
// and gather_counts empty or one per rank with a total that fits. Other kinds have neither
// recv_capacity nor gather_counts. Returns "" when valid, else what is wrong.
std::string check_spec(const UnitSpec& spec, int ranks);

// "" when a group of this many tensors is allowed (1..kMaxGroupMembers), else the problem: the C
// ABI asks before it reads the caller's arrays.
std::string group_size_problem(int64_t members);

}  // namespace kolo::fusion
