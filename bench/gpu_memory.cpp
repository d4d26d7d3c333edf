// The -g mode's device memory (see gpu_memory.hpp). Compiled with KOLO_BENCH_GPU where the CUDA
// runtime was found; without it only available() is meaningful.
#include "gpu_memory.hpp"

#include <fmt/core.h>

#include <cstdlib>

#ifdef KOLO_BENCH_GPU
#include <cuda_runtime_api.h>
#endif

namespace kolo::bench::gpu {

#ifdef KOLO_BENCH_GPU
namespace {

void check_cuda(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  fmt::print(stderr, "CUDA error: {} failed: {} ({}): {}\n", what, cudaGetErrorName(error),
             static_cast<int>(error), cudaGetErrorString(error));
  std::exit(1);
}

cudaStream_t cuda(void* stream) {
  return static_cast<cudaStream_t>(stream);
}

}  // namespace

bool available(std::string* reason) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    *reason = fmt::format("cudaGetDeviceCount failed: {} ({}): {}", cudaGetErrorName(error),
                          static_cast<int>(error), cudaGetErrorString(error));
    return false;
  }
  if (count == 0) {
    *reason = "no CUDA device is visible";
    return false;
  }
  return true;
}

std::string select_device(int local_rank) {
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  const int device = local_rank % count;
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  cudaDeviceProp properties{};
  check_cuda(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
  char bus_id[64] = {};
  check_cuda(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device), "cudaDeviceGetPCIBusId");
  return fmt::format("device {} {} ({})", device, properties.name, bus_id);
}

void* create_stream() {
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  return stream;
}

void* default_stream() {
  return cudaStreamLegacy;
}

void destroy_stream(void* stream) {
  if (cuda(stream) != cudaStreamLegacy) cudaStreamDestroy(cuda(stream));
}

void* allocate(uint64_t bytes) {
  void* device = nullptr;
  check_cuda(cudaMalloc(&device, bytes == 0 ? 1 : bytes), "cudaMalloc");
  check_cuda(cudaMemset(device, 0, bytes == 0 ? 1 : bytes), "cudaMemset");
  return device;
}

void release(void* device) {
  cudaFree(device);
}

void copy_to_device(void* device, const void* host, uint64_t bytes, void* stream) {
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, cuda(stream)),
             "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(cuda(stream)), "cudaStreamSynchronize");
}

void copy_to_host(void* host, const void* device, uint64_t bytes, void* stream) {
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, cuda(stream)),
             "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(cuda(stream)), "cudaStreamSynchronize");
}

void fill(void* device, int byte, uint64_t bytes, void* stream) {
  if (bytes == 0) return;
  check_cuda(cudaMemsetAsync(device, byte, bytes, cuda(stream)), "cudaMemsetAsync");
  check_cuda(cudaStreamSynchronize(cuda(stream)), "cudaStreamSynchronize");
}

#else

bool available(std::string* reason) {
  *reason = "kolo was built without CUDA";
  return false;
}

namespace {
[[noreturn]] void unavailable() {
  fmt::print(stderr, "GPU buffers: kolo was built without CUDA\n");
  std::exit(1);
}
}  // namespace

std::string select_device(int) {
  unavailable();
}
void* create_stream() {
  unavailable();
}
void* default_stream() {
  unavailable();
}
void destroy_stream(void*) {}
void* allocate(uint64_t) {
  unavailable();
}
void release(void*) {}
void copy_to_device(void*, const void*, uint64_t, void*) {
  unavailable();
}
void copy_to_host(void*, const void*, uint64_t, void*) {
  unavailable();
}
void fill(void*, int, uint64_t, void*) {
  unavailable();
}

#endif

}  // namespace kolo::bench::gpu
