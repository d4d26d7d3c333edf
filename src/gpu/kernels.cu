// The device kernels behind gpu/kernels.hpp: a batched copy whose table of regions travels in the
// kernel's parameters, and element-wise scaling with the host kernels' arithmetic.
//
// Batched copy. One launch covers up to kMaxRegions regions: blockIdx.y picks the region and the
// blocks along x stride through it, 16 bytes per thread and step when the region's source and
// destination are 16-byte aligned (4 when 4-byte aligned, else 1). The table is a
// __grid_constant__ parameter, so a block reads its region straight from the parameter bank
// instead of copying the table to local memory; small tables use a small parameter struct, so
// that launching a batch of three tensors does not ship 24 KiB of parameters.
//
// Arithmetic (as src/core/reduce.cpp): float32, float16 and bfloat16 compute in float32 and round
// to nearest even once; float64 in double; integers scale in double, truncate toward zero and
// saturate, and divide exactly (truncating toward zero).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gpu/kernel_launch.hpp"

namespace kolo::gpu::launch {
namespace {

constexpr int kThreads = 256;

// ---- Element arithmetic -------------------------------------------------------------------------

// Acc is the type an element is computed in; widen and narrow convert to and from it.
template <typename T>
struct Math {
  using Acc = T;
  __device__ static Acc widen(T value) { return value; }
  __device__ static T narrow(Acc value) { return value; }
};
template <>
struct Math<__half> {
  using Acc = float;
  __device__ static float widen(__half value) { return __half2float(value); }
  __device__ static __half narrow(float value) { return __float2half_rn(value); }
};
template <>
struct Math<__nv_bfloat16> {
  using Acc = float;
  __device__ static float widen(__nv_bfloat16 value) { return __bfloat162float(value); }
  __device__ static __nv_bfloat16 narrow(float value) { return __float2bfloat16_rn(value); }
};

template <typename Int>
struct Limits;
template <>
struct Limits<int8_t> {
  static constexpr int8_t kLowest = -128;
  static constexpr int8_t kHighest = 127;
};
template <>
struct Limits<uint8_t> {
  static constexpr uint8_t kLowest = 0;
  static constexpr uint8_t kHighest = 255;
};
template <>
struct Limits<int32_t> {
  static constexpr int32_t kLowest = INT32_MIN;
  static constexpr int32_t kHighest = INT32_MAX;
};
template <>
struct Limits<int64_t> {
  static constexpr int64_t kLowest = INT64_MIN;
  static constexpr int64_t kHighest = INT64_MAX;
};

// value * factor in double, truncated toward zero, saturated; a NaN product gives 0.
template <typename Int>
__device__ Int scale_integer(Int value, double factor) {
  const double scaled = static_cast<double>(value) * factor;
  if (scaled != scaled) return 0;
  if constexpr (sizeof(Int) == 8) {
    // INT64_MAX is not a double; 2^63 is the first double out of range.
    if (scaled >= 9223372036854775808.0) return Limits<Int>::kHighest;
    if (scaled < -9223372036854775808.0) return Limits<Int>::kLowest;
  } else {
    if (scaled < static_cast<double>(Limits<Int>::kLowest)) return Limits<Int>::kLowest;
    if (scaled > static_cast<double>(Limits<Int>::kHighest)) return Limits<Int>::kHighest;
  }
  return static_cast<Int>(scaled);
}

template <typename T>
struct ScaleOp {
  using Acc = typename Math<T>::Acc;
  static constexpr bool kFloat = std::is_floating_point<Acc>::value;
  using Factor = std::conditional_t<kFloat, Acc, double>;
  Factor factor;

  __device__ T operator()(T value) const {
    if constexpr (kFloat) {
      return Math<T>::narrow(Math<T>::widen(value) * factor);
    } else {
      return scale_integer<T>(value, factor);
    }
  }
};

template <typename T>
struct FinishOp {
  using Acc = typename Math<T>::Acc;
  static constexpr bool kFloat = std::is_floating_point<Acc>::value;
  using Factor = std::conditional_t<kFloat, Acc, double>;
  using Divisor = std::conditional_t<kFloat, Acc, int64_t>;
  Divisor divisor;
  Factor postscale;
  bool divide;
  bool multiply;

  __device__ T operator()(T element) const {
    Acc value = Math<T>::widen(element);
    if constexpr (kFloat) {
      if (divide) value = value / divisor;
      if (multiply) value = value * postscale;
      return Math<T>::narrow(value);
    } else {
      if (divide) value = static_cast<Acc>(static_cast<int64_t>(value) / divisor);
      if (multiply) value = scale_integer<T>(value, postscale);
      return value;
    }
  }
};

// ---- Kernels ------------------------------------------------------------------------------------

template <typename T, typename Op>
__global__ void map_kernel(const T* source, T* destination, unsigned long long count, Op op) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i =
           static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count; i += stride) {
    destination[i] = op(source[i]);
  }
}

template <int kCapacity>
struct RegionTable {
  Region regions[kCapacity];
};

__device__ void copy_region(const Region& region, unsigned long long first,
                            unsigned long long stride) {
  const auto* source = static_cast<const unsigned char*>(region.source);
  auto* destination = static_cast<unsigned char*>(region.destination);
  const unsigned long long bytes = region.bytes;
  const auto alignment =
      reinterpret_cast<uintptr_t>(source) | reinterpret_cast<uintptr_t>(destination);
  unsigned long long done = 0;
  if ((alignment & 15u) == 0) {
    const unsigned long long vectors = bytes / 16;
    const auto* from = reinterpret_cast<const uint4*>(source);
    auto* to = reinterpret_cast<uint4*>(destination);
    for (unsigned long long i = first; i < vectors; i += stride) to[i] = from[i];
    done = vectors * 16;
  } else if ((alignment & 3u) == 0) {
    const unsigned long long words = bytes / 4;
    const auto* from = reinterpret_cast<const uint32_t*>(source);
    auto* to = reinterpret_cast<uint32_t*>(destination);
    for (unsigned long long i = first; i < words; i += stride) to[i] = from[i];
    done = words * 4;
  }
  for (unsigned long long i = done + first; i < bytes; i += stride) destination[i] = source[i];
}

template <int kCapacity>
__global__ void copy_bytes_kernel(const __grid_constant__ RegionTable<kCapacity> table) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  copy_region(table.regions[blockIdx.y],
              static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x, stride);
}

template <typename T, int kCapacity>
__global__ void copy_scaled_kernel(const __grid_constant__ RegionTable<kCapacity> table,
                                   ScaleOp<T> op) {
  const Region& region = table.regions[blockIdx.y];
  const auto* source = static_cast<const T*>(region.source);
  auto* destination = static_cast<T*>(region.destination);
  const unsigned long long count = region.bytes / sizeof(T);
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i =
           static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count; i += stride) {
    destination[i] = op(source[i]);
  }
}

// ---- Dispatch -----------------------------------------------------------------------------------

template <typename T>
struct Tag {
  using Type = T;
};

// Calls function(Tag<T>{}) with the element type of code; false for an unknown code.
template <typename Function>
bool with_element(int element, Function&& function) {
  switch (element) {
    case 0:
      function(Tag<float>{});
      return true;
    case 1:
      function(Tag<double>{});
      return true;
    case 2:
      function(Tag<__half>{});
      return true;
    case 3:
      function(Tag<__nv_bfloat16>{});
      return true;
    case 4:
      function(Tag<int8_t>{});
      return true;
    case 5:
      function(Tag<uint8_t>{});
      return true;
    case 6:
      function(Tag<int32_t>{});
      return true;
    case 7:
      function(Tag<int64_t>{});
      return true;
    default:
      return false;
  }
}

// Enough blocks to give each thread a few elements, no more than the grid needs.
unsigned map_blocks(unsigned long long count) {
  const unsigned long long per_block = kThreads * 4ull;
  return static_cast<unsigned>(
      std::min<unsigned long long>((count + per_block - 1) / per_block, 65535ull));
}

template <int kCapacity>
cudaError_t batched_copy_with(const Region* regions, int count, int element, double factor,
                              cudaStream_t stream) {
  RegionTable<kCapacity> table;
  std::memset(&table, 0, sizeof(table));
  unsigned long long largest = 0;
  for (int i = 0; i < count; ++i) {
    table.regions[i] = regions[i];
    largest = std::max(largest, regions[i].bytes);
  }
  if (largest == 0) return cudaSuccess;
  // About 16 KiB of a region per block and pass, and no more than 32768 blocks in all.
  const unsigned long long per_block = kThreads * 64ull;
  const unsigned long long wanted = (largest + per_block - 1) / per_block;
  const unsigned long long cap = std::max(1ull, 32768ull / static_cast<unsigned long long>(count));
  const dim3 grid(static_cast<unsigned>(std::min(wanted, cap)), static_cast<unsigned>(count));
  if (element == kBytes) {
    copy_bytes_kernel<kCapacity><<<grid, kThreads, 0, stream>>>(table);
    return cudaGetLastError();
  }
  bool known = with_element(element, [&](auto tag) {
    using T = typename decltype(tag)::Type;
    ScaleOp<T> op{static_cast<typename ScaleOp<T>::Factor>(factor)};
    copy_scaled_kernel<T, kCapacity><<<grid, kThreads, 0, stream>>>(table, op);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace

cudaError_t batched_copy(const Region* regions, int count, int element, double factor,
                         cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count > kMaxRegions) return cudaErrorInvalidValue;
  if (count <= 32) return batched_copy_with<32>(regions, count, element, factor, stream);
  return batched_copy_with<kMaxRegions>(regions, count, element, factor, stream);
}

cudaError_t scale(const void* source, void* destination, unsigned long long count, int element,
                  double factor, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  bool known = with_element(element, [&](auto tag) {
    using T = typename decltype(tag)::Type;
    ScaleOp<T> op{static_cast<typename ScaleOp<T>::Factor>(factor)};
    map_kernel<T><<<map_blocks(count), kThreads, 0, stream>>>(
        static_cast<const T*>(source), static_cast<T*>(destination), count, op);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t finish(void* data, unsigned long long count, int element, int divisor, double postscale,
                   cudaStream_t stream) {
  if (count == 0 || (divisor <= 1 && postscale == 1.0)) return cudaSuccess;
  bool known = with_element(element, [&](auto tag) {
    using T = typename decltype(tag)::Type;
    using Op = FinishOp<T>;
    Op op{static_cast<typename Op::Divisor>(divisor < 1 ? 1 : divisor),
          static_cast<typename Op::Factor>(postscale), divisor > 1, postscale != 1.0};
    map_kernel<T><<<map_blocks(count), kThreads, 0, stream>>>(static_cast<const T*>(data),
                                                              static_cast<T*>(data), count, op);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace kolo::gpu::launch
