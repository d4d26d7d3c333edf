// What one collective call is, as every message of it says on the wire. A receiver compares the
// descriptor of each incoming message with its own; any difference means the ranks disagree.
#pragma once

#include <cstdint>
#include <string>

#include "kolo/dtype.hpp"

namespace kolo {

enum class Collective : uint8_t {
  kAllreduce = 1,
  kBroadcast = 2,
  kBarrier = 3,
};

const char* collective_name(Collective collective);

struct OpDescriptor {
  Collective collective = Collective::kAllreduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  uint8_t reserved = 0;
  int32_t root = -1;        // -1 for collectives without a root
  uint64_t count = 0;
  uint64_t sequence = 0;    // per-communicator collective number, from 1
  double prescale = 1.0;
  double postscale = 1.0;

  bool operator==(const OpDescriptor&) const = default;
};
static_assert(sizeof(OpDescriptor) == 40, "OpDescriptor is sent as it is laid out in memory");

// "allreduce #3 (count 10, float32, sum)", with root and scale factors where they matter.
std::string describe(const OpDescriptor& descriptor);

}  // namespace kolo
