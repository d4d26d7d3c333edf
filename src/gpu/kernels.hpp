// Device-side kernels: batched copies for the fusion buffer, and scaling on the device.
//
// The fusion engine (src/fusion/) packs many small tensors into one buffer before a collective and
// unpacks them after it. With tensors in GPU memory a cudaMemcpyAsync per tensor costs a few
// microseconds of launch each, which dominates for a thousand small gradients; batched_copy()
// copies a whole table of (source, destination, bytes) regions in one kernel launch instead. The
// table travels in the kernel's parameters (up to kMaxRegionsPerLaunch regions, which needs CUDA
// 12.1 or later for parameters beyond 4 KiB), so nothing is allocated and nothing outlives the
// call; a longer table takes one launch per kMaxRegionsPerLaunch regions.
//
// Scaling follows the host kernels (src/core/reduce.hpp) exactly: float32, float16 and bfloat16
// scale in float32 (the factor rounded to float32 once) and round to nearest even; float64 scales
// in double; integers scale in double, truncate toward zero and saturate at the type's limits (a
// NaN product gives 0). AVG of integers divides exactly, truncating toward zero.
//
// Every function enqueues work on `stream` and returns at once; it throws kolo::Error (kSystem
// with CUDA's message, or kInvalidArgument) when the launch fails, and kUnsupported in a build
// without CUDA. All pointers are device (or managed) memory of the current device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "gpu/gpu.hpp"
#include "kolo/dtype.hpp"

namespace kolo::gpu {

// One region of a batched copy. Regions must not overlap one another's destinations.
struct CopyRegion {
  const void* source = nullptr;
  void* destination = nullptr;
  uint64_t bytes = 0;
};

inline constexpr size_t kMaxRegionsPerLaunch = 1024;

// Copies every region, in one launch per kMaxRegionsPerLaunch regions. Regions whose pointers
// and length are multiples of 16 bytes move 16 bytes per thread and instruction; others 1.
void batched_copy(std::span<const CopyRegion> regions, Stream stream);

// As batched_copy, multiplying every element by factor on the way (dtype elements: every
// region's bytes must be a multiple of the element size). factor == 1 is a plain copy.
void batched_copy_scaled(std::span<const CopyRegion> regions, DataType dtype, double factor,
                         Stream stream);

// destination[i] = source[i] * factor for count elements; destination may equal source.
void scale(const void* source, void* destination, uint64_t count, DataType dtype, double factor,
           Stream stream);

// What AVG and the postscale leave to do after a plain sum: data[i] = data[i] / divisor (integer
// division truncating toward zero for integers, division in the accumulator type for floats;
// divisor 1 skips it), then * postscale. In place.
void finish_reduction(void* data, uint64_t count, DataType dtype, int divisor, double postscale,
                      Stream stream);

}  // namespace kolo::gpu
