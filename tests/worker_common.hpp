// What every test worker that checks results through the C ABI needs: this process's place in the
// world, a failure that names the rank and ends the process, and a status check that names the
// call. Used by tests/worker.cpp, tests/worker_collectives.cpp, tests/worker_soak.cpp and
// tests/gpu/gpu_worker.cpp; each includes it once, in its one translation unit.
#pragma once

#include <fmt/format.h>
#include <kolo.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace kolo::test::worker {

// This rank and the number of ranks in the world communicator, once the worker has set them.
inline int g_rank = 0;
inline int g_size = 1;

[[noreturn]] inline void fail(const std::string& message) {
  fmt::print(stderr, "rank {}: FAILED: {}\n", g_rank, message);
  std::exit(1);
}

inline void check_status(kolo_comm_t comm, kolo_status_t status, const std::string& what) {
  if (status != KOLO_SUCCESS) {
    fail(fmt::format("{} returned {}: {}", what, kolo_status_string(status),
                     kolo_comm_last_error(comm)));
  }
}

// A communicator and this rank's place in it.
struct Comm {
  kolo_comm_t handle = nullptr;
  int rank = 0;
  int size = 1;
};

inline Comm describe_comm(kolo_comm_t handle) {
  Comm comm{handle, -1, -1};
  check_status(handle, kolo_comm_rank(handle, &comm.rank), "kolo_comm_rank");
  check_status(handle, kolo_comm_size(handle, &comm.size), "kolo_comm_size");
  return comm;
}

}  // namespace kolo::test::worker
