// One NCCL communicator, bootstrapped through kolo's rendezvous store and watched by kolo's own
// bounded waits. Used by the GPU backend (src/gpu/backend.cpp) for buffers in device memory when
// every rank has a GPU of its own.
//
// Start-up: rank 0 calls ncclGetUniqueId() and publishes the id in the store under
// <key_prefix>/nccl-id; every rank reads it and calls ncclCommInitRankConfig() on the device it
// was given. The communicator is created non-blocking (ncclConfig_t.blocking = 0), so that no NCCL
// call can hang: every ncclInProgress is polled with ncclCommGetAsyncError() until it settles,
// no longer than the timeout, calling the watchdog about every millisecond. The watchdog lets the
// kolo communicator report a peer that its own transport saw die (it throws, and the NCCL
// communicator is aborted before the error goes on).
//
// Errors: any NCCL failure, asynchronous ones included, aborts the NCCL communicator at once
// (ncclCommAbort() ends kernels still waiting for a dead peer, so streams drain) and throws
// kolo::Error with NCCL's message (ncclGetErrorString and ncclGetLastError). ncclRemoteError
// becomes KOLO_ERR_PEER_LOST, ncclInvalidUsage KOLO_ERR_UNSUPPORTED (such as two ranks on one
// GPU), ncclInternalError and ncclInvalidArgument KOLO_ERR_INTERNAL (kolo checks arguments
// before it calls NCCL), and system and CUDA errors KOLO_ERR_SYSTEM. After a failure every call
// throws the same error.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "kolo/dtype.hpp"
#include "kolo/status.hpp"

namespace kolo {

class StoreClient;

namespace nccl {

// Called while waiting; throws kolo::Error to stop waiting (a peer kolo knows to be lost).
using Watchdog = std::function<void()>;

class NcclCommunicator {
 public:
  // Collective over the kolo communicator's ranks; device is the CUDA device this rank uses.
  NcclCommunicator(StoreClient& store, const std::string& key_prefix, int rank, int size,
                   int device, double timeout_s, Watchdog watchdog);
  // Finalizes and destroys the communicator (bounded), or aborts it if it failed, if finalizing
  // does not settle in time, or if the watchdog reports a problem.
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int device() const { return device_; }
  int size() const { return size_; }

  // Enqueue on stream; the caller has made device() current. `what` names the kolo call in
  // errors ("allreduce #4 (count 10, float32, sum)"). prescale != 1 is for float32 and float64
  // SUM and AVG only: a pre-multiplying sum (ncclRedOpCreatePreMulSum), by prescale / size for
  // AVG. Integer AVG is not NCCL's: the caller sums and divides itself.
  void allreduce(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype, ReduceOp op,
                 double prescale, cudaStream_t stream, const std::string& what);
  void broadcast(void* buffer, uint64_t count, DataType dtype, int root, cudaStream_t stream,
                 const std::string& what);
  // recvbuf holds size() * count elements; sendbuf count.
  void allgather(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype,
                 cudaStream_t stream, const std::string& what);
  // sendbuf holds size() * count elements; recvbuf count.
  void reduce_scatter(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype,
                      ReduceOp op, cudaStream_t stream, const std::string& what);

  // Throws the communicator's asynchronous error (after aborting it), if there is one.
  void check(const std::string& what);
  // Ends the communicator now: in-flight kernels stop, later calls throw. Never throws.
  void abort(const Error& why) noexcept;

 private:
  // Settles an NCCL call's result: ncclInProgress is polled until done (bounded), failure aborts
  // and throws.
  void settle(ncclResult_t result, const char* call, const std::string& what);
  // Polls ncclCommGetAsyncError until it leaves ncclInProgress or the deadline; returns the state.
  ncclResult_t wait_while_in_progress(const char* call, const std::string& what);
  [[noreturn]] void fail(ncclResult_t result, const char* call, const std::string& what);
  void throw_if_failed() const;

  ncclComm_t comm_ = nullptr;
  int rank_;
  int size_;
  int device_;
  double timeout_s_;
  Watchdog watchdog_;
  std::optional<Error> failure_;
};

// ncclFloat32, ..., for kolo's dtypes (all eight have an NCCL type).
ncclDataType_t nccl_type(DataType dtype);

}  // namespace nccl
}  // namespace kolo
