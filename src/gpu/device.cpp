// Recognising device pointers (see gpu/gpu.hpp).
//
// Cost for host buffers. cudaGetDeviceCount() runs once per process and creates no CUDA context.
// cudaPointerGetAttributes() would create one (the primary context of device 0, with hundreds of
// megabytes of device memory and a noticeable start-up) in a process that never touched the GPU,
// which a CPU-only program on a GPU machine must not pay for. So until some CUDA context exists
// in the process, no pointer can be device memory and none is looked up: the driver is asked
// whether a context is current on this thread or any device's primary context is active (two
// cheap driver calls, through libcuda.so.1, which the CUDA runtime has already loaded). Once one
// has been seen, buffers are looked up directly.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <string>

#include "core/log.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/gpu.hpp"

namespace kolo::gpu {
namespace {

using DeviceGetFunction = CUresult (*)(CUdevice*, int);
using PrimaryContextStateFunction = CUresult (*)(CUdevice, unsigned int*, int*);
using CurrentContextFunction = CUresult (*)(CUcontext*);

struct Probe {
  std::once_flag once;
  std::atomic<bool> probed{false};  // run_probe() has finished
  std::atomic<bool> present{false};
  std::string absent_reason;  // written once, under `once`
  int device_count = 0;
  // Driver entry points for context_may_exist(); null when they could not be found, and then
  // every pointer is looked up.
  DeviceGetFunction device_get = nullptr;
  PrimaryContextStateFunction primary_context_state = nullptr;
  CurrentContextFunction current_context = nullptr;
  std::atomic<bool> context_seen{false};
};

Probe& probe() {
  static Probe instance;
  return instance;
}

void find_driver_functions(Probe& state) {
  // RTLD_NOLOAD: the CUDA runtime loaded the driver library for cudaGetDeviceCount; take that
  // one, never load another.
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (driver == nullptr) return;
  state.device_get = reinterpret_cast<DeviceGetFunction>(dlsym(driver, "cuDeviceGet"));
  state.primary_context_state =
      reinterpret_cast<PrimaryContextStateFunction>(dlsym(driver, "cuDevicePrimaryCtxGetState"));
  state.current_context =
      reinterpret_cast<CurrentContextFunction>(dlsym(driver, "cuCtxGetCurrent"));
  if (!state.device_get || !state.primary_context_state || !state.current_context) {
    state.device_get = nullptr;
    state.primary_context_state = nullptr;
    state.current_context = nullptr;
  }
}

void run_probe(Probe& state) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error == cudaSuccess && count > 0) {
    state.device_count = count;
    find_driver_functions(state);
    state.present.store(true, std::memory_order_release);
    log::info("{} CUDA device(s) visible: device buffers are recognised", count);
  } else {
    if (error != cudaSuccess) (void)cudaGetLastError();
    state.absent_reason = error != cudaSuccess
                              ? "cudaGetDeviceCount failed: " + cuda_error_text(error)
                              : "cudaGetDeviceCount found no CUDA device";
    log::info("no GPU buffers: {}", state.absent_reason);
  }
  state.probed.store(true, std::memory_order_release);
}

// False only when the driver says that no CUDA context exists in this process (so that no
// pointer can be device memory); true when one does, or when the driver cannot be asked.
bool context_may_exist(Probe& state) {
  if (state.context_seen.load(std::memory_order_relaxed)) return true;
  if (state.current_context == nullptr) return true;
  bool found = false;
  CUcontext current = nullptr;
  if (state.current_context(&current) == CUDA_SUCCESS && current != nullptr) found = true;
  for (int ordinal = 0; !found && ordinal < state.device_count; ++ordinal) {
    CUdevice device = 0;
    unsigned int flags = 0;
    int active = 0;
    if (state.device_get(&device, ordinal) == CUDA_SUCCESS &&
        state.primary_context_state(device, &flags, &active) == CUDA_SUCCESS && active != 0) {
      found = true;
    }
  }
  if (found) state.context_seen.store(true, std::memory_order_relaxed);
  return found;
}

}  // namespace

bool devices_present() {
  Probe& state = probe();
  // Every collective asks (gpu::locate); libstdc++'s call_once writes thread-local state even when
  // the call is long done, which an 8-byte allreduce notices.
  if (!state.probed.load(std::memory_order_acquire)) {
    std::call_once(state.once, run_probe, std::ref(state));
  }
  return state.present.load(std::memory_order_acquire);
}

std::string devices_absent_reason() {
  return devices_present() ? std::string() : probe().absent_reason;
}

MemoryLocation locate(const void* pointer) {
  if (pointer == nullptr || !devices_present() || !context_may_exist(probe())) return {};
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    (void)cudaGetLastError();  // not memory CUDA knows of: host memory
    return {};
  }
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) {
    return {true, attributes.device};
  }
  return {};
}

}  // namespace kolo::gpu
