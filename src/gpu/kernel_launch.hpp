// The launchers of gpu/kernels.cu, in plain types: nvcc compiles kernels.cu as C++17 without the
// rest of kolo, and gpu/kernels.cpp turns these into the C++ API of gpu/kernels.hpp. Internal to
// src/gpu/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kolo::gpu::launch {

struct Region {
  const void* source;
  void* destination;
  unsigned long long bytes;
};

// Element codes are kolo::DataType's values (float32 0, float64 1, float16 2, bfloat16 3, int8 4,
// uint8 5, int32 6, int64 7); kBytes copies bytes without scaling.
inline constexpr int kBytes = -1;

// The most regions one launch takes (its table travels in the kernel's parameters).
inline constexpr int kMaxRegions = 1024;

// Copies count <= kMaxRegions regions in one launch; with element >= 0 every element is
// multiplied by factor on the way.
cudaError_t batched_copy(const Region* regions, int count, int element, double factor,
                         cudaStream_t stream);
// destination[i] = source[i] * factor.
cudaError_t scale(const void* source, void* destination, unsigned long long count, int element,
                  double factor, cudaStream_t stream);
// data[i] = data[i] / divisor (divisor > 1 only), then * postscale (postscale != 1 only).
cudaError_t finish(void* data, unsigned long long count, int element, int divisor, double postscale,
                   cudaStream_t stream);

}  // namespace kolo::gpu::launch
