// The one bounded wait for GPU work (internal to src/gpu/): polls a CUDA query (cudaEventQuery,
// cudaStreamQuery) until it stops saying cudaErrorNotReady, spinning for the first 100 µs (a short
// collective should not pay a scheduler round trip), then yielding, then sleeping 50 µs between
// polls after 10 ms. `watch` runs on the first poll that finds the work unfinished and about every
// millisecond after; it may throw to stop waiting (an NCCL asynchronous error, a peer that kolo's
// transport saw die). Past timeout_s it throws kolo::Error(kTimeout) with `what` and `on_timeout`'s
// text.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <chrono>
#include <string>
#include <thread>

#include "core/deadline.hpp"
#include "gpu/cuda_check.hpp"
#include "kolo/status.hpp"

namespace kolo::gpu {

template <typename Query, typename Watch>
void wait_until_ready(Query&& query, Watch&& watch, double timeout_s, const std::string& what) {
  using std::chrono::microseconds;
  using std::chrono::milliseconds;
  const auto start = Clock::now();
  const Deadline deadline(timeout_s);
  auto next_watch = start;
  for (;;) {
    const cudaError_t state = query();
    if (state == cudaSuccess) return;
    if (state != cudaErrorNotReady) {
      (void)cudaGetLastError();
      throw Error(cuda_error_status(state),
                  fmt::format("{}: the GPU reported {}", what, cuda_error_text(state)));
    }
    const auto now = Clock::now();
    const auto waited = now - start;
    if (now >= next_watch) {
      watch();
      next_watch = now + milliseconds(1);
    }
    if (deadline.expired()) {
      throw Error(Status::kTimeout,
                  fmt::format("{}: the GPU work did not finish within {} s", what, timeout_s));
    }
    if (waited >= milliseconds(10)) {
      std::this_thread::sleep_for(microseconds(50));
    } else if (waited >= microseconds(100)) {
      std::this_thread::yield();
    }
  }
}

}  // namespace kolo::gpu
