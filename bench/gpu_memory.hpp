// Device memory and a CUDA stream for the benchmarks' -g mode (buffers in GPU memory, as
// nccl-tests has them). No CUDA header is needed to include this file. Every function prints what
// failed and exits with 1 on a CUDA error, as check() does for kolo's errors. In a build without
// CUDA, available() says so and nothing else may be called.
#pragma once

#include <cstdint>
#include <string>

namespace kolo::bench::gpu {

// True when the build has CUDA and a device is visible; otherwise *reason says why.
bool available(std::string* reason);
// Makes device (local_rank modulo the number of devices) current for this process; returns a
// description such as "device 0 NVIDIA H200 (0000:19:00.0)".
std::string select_device(int local_rank);

void* create_stream();   // a cudaStream_t, non-blocking
void* default_stream();  // CUDA's legacy default stream (-y 1), never destroyed
void destroy_stream(void* stream);

void* allocate(uint64_t bytes);  // device memory (at least one byte)
void release(void* device);

// Ordered on stream, and finished when they return.
void copy_to_device(void* device, const void* host, uint64_t bytes, void* stream);
void copy_to_host(void* host, const void* device, uint64_t bytes, void* stream);
void fill(void* device, int byte, uint64_t bytes, void* stream);

}  // namespace kolo::bench::gpu
