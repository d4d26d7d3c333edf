// What every rank must agree on about one named submission: the unit of negotiation.
//
// A unit is one named tensor (kolo_allreduce_async, kolo_broadcast_async) or a group of them
// (kolo_allreduce_group_async), which is negotiated, cached and executed as one. It is identified
// by its key, the name of its first member; every member name is unique among the requests that
// are pending on a rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kolo/dtype.hpp"

namespace kolo::fusion {

// Bounds on what a rank submits and, equally, on what a negotiation message may carry.
inline constexpr size_t kMaxNameBytes = 1024;
inline constexpr size_t kMaxGroupMembers = 4096;

enum class Kind : uint8_t {
  kAllreduce = 1,
  kBroadcast = 2,
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

  const std::string& key() const { return members.front().name; }
  uint64_t total_count() const;
  uint64_t total_bytes() const { return total_count() * dtype_size(dtype); }

  bool operator==(const UnitSpec&) const = default;
};

// "allreduce 'conv1.weight' (count 9408, float32, avg)", or for a group
// "allreduce group 'a' (count 10), 'b' (count 20) (float32, sum, prescale 0.5)". Long groups are
// elided after a few members.
std::string describe(const UnitSpec& spec);

// Whether a and b may share one fused collective: allreduces of the same dtype, op and factors.
bool fusable(const UnitSpec& a, const UnitSpec& b);

// Checks a spec built from a caller's arguments or read from a peer: known kind, dtype and op,
// finite factors, a root in [0, ranks) for broadcasts, 1..kMaxGroupMembers members with names of
// 1..kMaxNameBytes bytes, distinct, and counts whose byte size fits in 63 bits. Returns "" when
// valid, else what is wrong.
std::string check_spec(const UnitSpec& spec, int ranks);

}  // namespace kolo::fusion
