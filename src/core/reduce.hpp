// Reduction kernels: the arithmetic of every reducing collective, for every dtype and op.
//
// A ring reduction of one element passes a *partial* result from rank to rank. The first rank
// loads its own value into a partial, each following rank combines the incoming partial with its
// own value, and the last rank finishes: applies AVG's division and the postscale, and rounds to
// the element type. Partials are kept in the accumulator type: float32 for float16 and bfloat16
// (so a half reduction rounds once, at the very end), the element type itself otherwise.
//
// Every rank's own value is multiplied by `prescale` as it is loaded or combined. Integer types
// scale in double and truncate toward zero; integer SUM and PROD wrap around (two's complement).
// Integer AVG divides the finished sum by `ranks`, truncating toward zero. Float AVG divides (it
// does not multiply by a reciprocal), so an exact sum gives a correctly rounded average.
//
// The same inputs give bitwise the same outputs on every machine that runs the same build: no
// kernel reorders an element's operations, and vector and scalar paths agree exactly.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kolo/dtype.hpp"

namespace kolo {

struct ReduceSpec {
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  double prescale = 1.0;
  double postscale = 1.0;
  int ranks = 1;  // number of contributions; AVG divides by it
};

// float32 for float16 and bfloat16, dtype itself otherwise.
DataType accumulator_type(DataType dtype);
inline size_t accumulator_size(DataType dtype) { return dtype_size(accumulator_type(dtype)); }

// partial[i] = acc(own[i]) * prescale
void reduce_load(void* partial, const void* own, size_t count, const ReduceSpec& spec);

// partial_out[i] = partial_in[i] OP acc(own[i]) * prescale.  partial_out may equal partial_in.
void reduce_combine(void* partial_out, const void* partial_in, const void* own, size_t count,
                    const ReduceSpec& spec);

// out[i] = round(finish(partial_in[i] OP acc(own[i]) * prescale)), finish = AVG division and
// postscale. out is of the element type; it may equal own.
void reduce_finish(void* out, const void* partial_in, const void* own, size_t count,
                   const ReduceSpec& spec);

// The whole reduction of a single contribution (one rank): out[i] = round(finish(acc(own[i]) *
// prescale)). out may equal own.
void reduce_single(void* out, const void* own, size_t count, const ReduceSpec& spec);

// Half-precision conversions (round to nearest even; NaN stays NaN, overflow gives infinity).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);

}  // namespace kolo
