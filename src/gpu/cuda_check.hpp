// CUDA runtime errors as kolo errors, and the current device kept as the caller had it. Internal
// to src/gpu/, the only folder that includes CUDA headers.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <string>

#include "kolo/status.hpp"

namespace kolo::gpu {

// "cudaErrorInsufficientDriver (35): CUDA driver version is insufficient for CUDA runtime version"
inline std::string cuda_error_text(cudaError_t error) {
  return fmt::format("{} ({}): {}", cudaGetErrorName(error), static_cast<int>(error),
                     cudaGetErrorString(error));
}

// Out of memory is KOLO_ERR_SYSTEM like a failed malloc; a missing driver or device
// KOLO_ERR_UNSUPPORTED; every other CUDA failure KOLO_ERR_SYSTEM, with CUDA's own words.
inline Status cuda_error_status(cudaError_t error) {
  switch (error) {
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
      return Status::kUnsupported;
    default:
      return Status::kSystem;
  }
}

// Throws kolo::Error naming `what` (such as "cudaMemcpyAsync") unless error is cudaSuccess. The
// thread's last CUDA error is cleared, so that the next call's check does not see it again.
inline void check_cuda(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error(cuda_error_status(error), fmt::format("{} failed: {}", what, cuda_error_text(error)));
}

// Makes `device` current for a scope and gives the caller back its own current device after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
      (void)cudaSetDevice(previous_);
    }
    (void)cudaGetLastError();
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace kolo::gpu
