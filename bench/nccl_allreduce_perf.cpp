// nccl_allreduce_perf: raw ncclAllReduce with the harness, flags, buffers and checks of
// all_reduce_perf -g, so that kolo's NCCL path can be read against NCCL itself on the same GPU
// buffers, the same stream and the same timing (a batch of -n calls enqueued, then the stream
// waited for). Run it with -g, under the same launcher as all_reduce_perf:
//
//   kolorun -np 1 nccl_allreduce_perf -g -b 1M -e 256M -f 4
//
// kolo is used only to start the job and to hand NCCL's unique id from rank 0 to the others
// (kolo_broadcast); every measured call is ncclAllReduce. KOLO_AVG is NCCL's ncclAvg, whose
// integer rounding may differ from kolo's reference (#wrong then counts it). Built only where NCCL
// was found.
#include <cuda_runtime_api.h>
#include <fmt/core.h>
#include <nccl.h>

#include <cstdlib>

#include "perf_common.hpp"

namespace {

using kolo::bench::Operation;
using kolo::bench::Shape;

ncclComm_t g_nccl = nullptr;  // left to the process's exit: the harness has no end hook

[[noreturn]] void nccl_failure(const char* call, ncclResult_t result) {
  fmt::print(stderr, "NCCL error: {} failed: {} ({}): {}\n", call, ncclGetErrorString(result),
             static_cast<int>(result), ncclGetLastError(g_nccl));
  std::exit(1);
}

// Created by the first call, which every rank makes in the same order, on the device the harness
// selected for -g.
ncclComm_t nccl_for(const Operation& operation) {
  if (g_nccl != nullptr) return g_nccl;
  ncclUniqueId id{};
  if (operation.rank == 0) {
    if (const ncclResult_t result = ncclGetUniqueId(&id); result != ncclSuccess) {
      nccl_failure("ncclGetUniqueId", result);
    }
  }
  kolo::bench::check(operation.comm,
                     kolo_broadcast(operation.comm, &id, sizeof(id), KOLO_UINT8, 0));
  if (const ncclResult_t result = ncclCommInitRank(&g_nccl, operation.ranks, id, operation.rank);
      result != ncclSuccess) {
    nccl_failure("ncclCommInitRank", result);
  }
  return g_nccl;
}

ncclDataType_t nccl_type(kolo_dtype_t dtype) {
  switch (dtype) {
    case KOLO_FLOAT64:
      return ncclFloat64;
    case KOLO_FLOAT16:
      return ncclFloat16;
    case KOLO_BFLOAT16:
      return ncclBfloat16;
    case KOLO_INT8:
      return ncclInt8;
    case KOLO_UINT8:
      return ncclUint8;
    case KOLO_INT32:
      return ncclInt32;
    case KOLO_INT64:
      return ncclInt64;
    case KOLO_INT16:  // NCCL has no 16-bit integer; -d never offers int16 (perf_options.cpp)
    case KOLO_FLOAT32:
      break;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(kolo_op_t op) {
  switch (op) {
    case KOLO_AVG:
      return ncclAvg;
    case KOLO_MIN:
      return ncclMin;
    case KOLO_MAX:
      return ncclMax;
    case KOLO_PROD:
      return ncclProd;
    case KOLO_SUM:
      break;
  }
  return ncclSum;
}

double busbw_factor(int ranks) {
  return 2.0 * (ranks - 1) / ranks;
}

Shape shape(uint64_t bytes, size_t element_size, int /*rank*/, int /*ranks*/) {
  return kolo::bench::same_count_shape(bytes, element_size);
}

kolo_status_t run(const Operation& operation, const void* sendbuf, void* recvbuf) {
  if (operation.stream == nullptr) {
    fmt::print(stderr, "nccl_allreduce_perf needs -g: NCCL reduces GPU memory only\n");
    std::exit(1);
  }
  const ncclResult_t result = ncclAllReduce(
      sendbuf, recvbuf, operation.shape.count, nccl_type(operation.dtype), nccl_op(operation.op),
      nccl_for(operation), static_cast<cudaStream_t>(operation.stream));
  if (result != ncclSuccess) nccl_failure("ncclAllReduce", result);
  return KOLO_SUCCESS;
}

void init_input(const Operation& operation, void* sendbuf) {
  kolo::bench::fill_input(operation, operation.rank, sendbuf, operation.shape.count, 0);
}

void expected_output(const Operation& operation, void* expected) {
  kolo::bench::fill_reduced(operation, expected, operation.shape.count, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const kolo::bench::Collective allreduce = {
      .name = "nccl_allreduce",
      .reduces = true,
      .rooted = false,
      .busbw_factor = busbw_factor,
      .shape = shape,
      .run = run,
      .init_input = init_input,
      .expected_output = expected_output,
      .gpu = true,
  };
  return kolo::bench::run_benchmark(argc, argv, allreduce);
}
