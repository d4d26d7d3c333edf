// The C++ face of the device kernels (gpu/kernels.hpp): argument checks, the split of long tables
// into launches, and CUDA errors as kolo errors. The kernels themselves are in gpu/kernels.cu.
#include "gpu/kernels.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "gpu/cuda_check.hpp"
#include "gpu/kernel_launch.hpp"

namespace kolo::gpu {
namespace {

static_assert(kMaxRegionsPerLaunch == static_cast<size_t>(launch::kMaxRegions));

cudaStream_t cuda_stream(Stream stream) {
  return static_cast<cudaStream_t>(stream.handle);
}

int element_code(DataType dtype, const char* what) {
  if (!is_valid(dtype)) {
    throw Error(Status::kInvalidArgument,
                fmt::format("{}: unknown dtype {}", what, static_cast<int>(dtype)));
  }
  return static_cast<int>(dtype);
}

void copy_regions(std::span<const CopyRegion> regions, int element, size_t element_bytes,
                  double factor, Stream stream, const char* what) {
  std::array<launch::Region, launch::kMaxRegions> table;
  for (size_t first = 0; first < regions.size(); first += table.size()) {
    const size_t count = std::min(table.size(), regions.size() - first);
    for (size_t i = 0; i < count; ++i) {
      const CopyRegion& region = regions[first + i];
      if (region.bytes > 0 && (region.source == nullptr || region.destination == nullptr)) {
        throw Error(Status::kInvalidArgument,
                    fmt::format("{}: region {} of {} bytes has a NULL pointer", what, first + i,
                                region.bytes));
      }
      if (region.bytes % element_bytes != 0) {
        throw Error(Status::kInvalidArgument,
                    fmt::format("{}: region {} has {} bytes, not a whole number of {}-byte "
                                "elements",
                                what, first + i, region.bytes, element_bytes));
      }
      table[i] = launch::Region{region.source, region.destination, region.bytes};
    }
    check_cuda(launch::batched_copy(table.data(), static_cast<int>(count), element, factor,
                                    cuda_stream(stream)),
               what);
  }
}

}  // namespace

void batched_copy(std::span<const CopyRegion> regions, Stream stream) {
  copy_regions(regions, launch::kBytes, 1, 1.0, stream, "batched copy");
}

void batched_copy_scaled(std::span<const CopyRegion> regions, DataType dtype, double factor,
                         Stream stream) {
  const int element = element_code(dtype, "batched scaled copy");
  if (factor == 1.0) {
    copy_regions(regions, launch::kBytes, dtype_size(dtype), 1.0, stream, "batched copy");
  } else {
    copy_regions(regions, element, dtype_size(dtype), factor, stream, "batched scaled copy");
  }
}

void scale(const void* source, void* destination, uint64_t count, DataType dtype, double factor,
           Stream stream) {
  const int element = element_code(dtype, "device scale");
  if (count == 0) return;
  if (factor == 1.0) {
    if (source != destination) {
      check_cuda(cudaMemcpyAsync(destination, source, count * dtype_size(dtype),
                                 cudaMemcpyDeviceToDevice, cuda_stream(stream)),
                 "cudaMemcpyAsync (device scale by 1)");
    }
    return;
  }
  check_cuda(launch::scale(source, destination, count, element, factor, cuda_stream(stream)),
             "device scale kernel");
}

void finish_reduction(void* data, uint64_t count, DataType dtype, int divisor, double postscale,
                      Stream stream) {
  const int element = element_code(dtype, "device finish");
  check_cuda(launch::finish(data, count, element, divisor, postscale, cuda_stream(stream)),
             "device finish kernel");
}

}  // namespace kolo::gpu
