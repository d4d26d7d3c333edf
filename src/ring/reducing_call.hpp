// The start that every reducing schedule (the allreduces, reduce-scatter, reduce) shares.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/op_descriptor.hpp"
#include "core/reduce.hpp"
#include "ring/ring.hpp"

namespace kolo {

// op's reduction over the ring's ranks and the caller's buffers as bytes; on a ring of one rank
// the collective is the local reduction of `count` elements, done here, and `finished` is true.
struct ReducingCall {
  ReduceSpec spec;
  const std::byte* input;
  std::byte* output;
  bool finished;

  ReducingCall(const Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
               uint64_t count)
      : spec{op.dtype, op.op, op.prescale, op.postscale, ring.size()},
        input(static_cast<const std::byte*>(sendbuf)),
        output(static_cast<std::byte*>(recvbuf)),
        finished(ring.size() == 1) {
    if (finished) reduce_single(output, input, count, spec);
  }
};

}  // namespace kolo
