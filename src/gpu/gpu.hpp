// GPU buffers, as the rest of kolo sees them: no CUDA header is needed to include this file.
//
// How a device pointer is recognised. kolo's C ABI takes `void*` buffers for host and device
// memory alike. The first time a collective asks, kolo calls cudaGetDeviceCount() once for the
// process. When that fails (no driver: error 35; no device: error 100) or finds no device, or
// when kolo was built without CUDA, every buffer is host memory from then on and the check costs
// one atomic load per call. Otherwise each buffer of a call is looked up with
// cudaPointerGetAttributes() (well under a microsecond): device and managed memory take the GPU
// path, everything else (pageable, pinned or registered host memory) the host path.
//
// Streams cross the C ABI as `void*` and live here as a Stream, so that the core never needs
// cudaStream_t.
#pragma once

#include <string>

#include "kolo/dtype.hpp"
#include "kolo/status.hpp"

namespace kolo::gpu {

// A cudaStream_t. handle == nullptr is CUDA's legacy default stream, as with CUDA itself.
struct Stream {
  void* handle = nullptr;
};

// Where a buffer lives.
struct MemoryLocation {
  bool device = false;  // device or managed memory: a GPU collective must be used
  int ordinal = -1;     // the CUDA device it belongs to, when `device`
};

// True when kolo was built with CUDA and this process sees at least one device. The first call
// asks CUDA (once per process, thread-safe); later calls are one atomic load.
bool devices_present();
// Why devices_present() is false, for messages: "kolo was built without CUDA", or CUDA's error,
// such as "cudaGetDeviceCount failed: cudaErrorInsufficientDriver (35): CUDA driver version is
// insufficient for CUDA runtime version". Empty when devices are present.
std::string devices_absent_reason();

// Where pointer lives; NULL, and every pointer when !devices_present(), is host memory.
MemoryLocation locate(const void* pointer);
inline bool is_device_memory(const void* pointer) {
  return locate(pointer).device;
}

// The GPU path (NCCL and kolo's device kernels) takes every dtype but int16, for which NCCL has
// no type. For int16 this throws KOLO_ERR_UNSUPPORTED naming the call and the rank; callers check
// before anything is sent, so the communicator stays usable.
inline void check_device_dtype(DataType dtype, const char* what, int rank) {
  if (dtype != DataType::kInt16) return;
  throw Error(Status::kUnsupported,
              std::string(what) + ": int16 buffers in device memory are not supported (NCCL has " +
                  "no 16-bit integer type); use int32, or host memory (rank " +
                  std::to_string(rank) + ")");
}

}  // namespace kolo::gpu
