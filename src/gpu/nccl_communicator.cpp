#include "gpu/nccl_communicator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "bootstrap/store.hpp"
#include "core/deadline.hpp"
#include "core/log.hpp"
#include "gpu/cuda_check.hpp"

namespace kolo::nccl {
namespace {

// How long destroying a healthy communicator may wait for ncclCommFinalize before aborting.
constexpr double kFinalizeSeconds = 10.0;

Status nccl_status(ncclResult_t result) {
  switch (result) {
    case ncclRemoteError:
      return Status::kPeerLost;
    case ncclInvalidUsage:
      return Status::kUnsupported;
    case ncclUnhandledCudaError:
    case ncclSystemError:
      return Status::kSystem;
    default:
      return Status::kInternal;
  }
}

std::string nccl_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = fmt::format("{} ({})", ncclGetErrorString(result), static_cast<int>(result));
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += fmt::format(": {}", last);
  return text;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProd:
      return ncclProd;
  }
  return ncclSum;
}

// The first byte of the published id says whether rank 0 could make one; if not, the rest is
// its error message, so that the other ranks fail at once instead of timing out.
constexpr uint8_t kIdMade = 1;
constexpr uint8_t kIdFailed = 0;

}  // namespace

ncclDataType_t nccl_type(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kInt8:
      return ncclInt8;
    case DataType::kUInt8:
      return ncclUint8;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kInt16:
      break;  // refused before any call (gpu::check_device_dtype)
  }
  throw Error(Status::kUnsupported, fmt::format("NCCL has no type for {}", dtype_name(dtype)));
}

NcclCommunicator::NcclCommunicator(StoreClient& store, const std::string& key_prefix, int rank,
                                   int size, int device, double timeout_s, Watchdog watchdog)
    : rank_(rank),
      size_(size),
      device_(device),
      timeout_s_(timeout_s),
      watchdog_(std::move(watchdog)) {
  const std::string key = key_prefix + "/nccl-id";
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) {
    const ncclResult_t made = ncclGetUniqueId(&id);
    std::vector<uint8_t> value(1 + sizeof(id));
    if (made != ncclSuccess) {
      const std::string text = "rank 0: ncclGetUniqueId failed: " + nccl_text(made, nullptr);
      value.assign(text.begin(), text.end());
      value.insert(value.begin(), kIdFailed);
      store.set(key, value);
      throw Error(nccl_status(made), "starting NCCL: " + text);
    }
    value[0] = kIdMade;
    std::memcpy(value.data() + 1, &id, sizeof(id));
    store.set(key, value);
  } else {
    const std::vector<uint8_t> value = store.get(key);
    if (value.empty() || value[0] != kIdMade || value.size() != 1 + sizeof(id)) {
      const std::string text = value.empty() ? std::string("an empty value")
                                             : std::string(value.begin() + 1, value.end());
      throw Error(Status::kSystem, fmt::format("starting NCCL on rank {}: no NCCL id from rank "
                                               "0: {}",
                                               rank, text));
    }
    std::memcpy(&id, value.data() + 1, sizeof(id));
  }

  gpu::DeviceScope scope(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; settle() polls with a deadline
  const ncclResult_t started = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
  settle(started, "ncclCommInitRankConfig",
         fmt::format("starting NCCL on rank {} of {} (device {})", rank, size, device));
  log::info("NCCL communicator ready: rank {} of {} on CUDA device {}", rank, size, device);
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ == nullptr) return;
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                        cudaSetDevice(device_) == cudaSuccess;
  ncclResult_t state = ncclCommFinalize(comm_);
  if (state == ncclSuccess || state == ncclInProgress) {
    const Deadline deadline(std::min(timeout_s_, kFinalizeSeconds));
    do {
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
      if (state == ncclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(100));
    } while (state == ncclInProgress && !deadline.expired());
  }
  if (state == ncclSuccess) {
    ncclCommDestroy(comm_);
  } else {
    log::warn("NCCL communicator did not finalize ({}); aborting it", nccl_text(state, comm_));
    ncclCommAbort(comm_);
  }
  comm_ = nullptr;
  if (switched) cudaSetDevice(previous);
  (void)cudaGetLastError();
}

void NcclCommunicator::abort(const Error& why) noexcept {
  if (!failure_) failure_.emplace(why);
  if (comm_ == nullptr) return;
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                        cudaSetDevice(device_) == cudaSuccess;
  ncclCommAbort(comm_);
  comm_ = nullptr;
  if (switched) cudaSetDevice(previous);
  (void)cudaGetLastError();
}

void NcclCommunicator::throw_if_failed() const {
  if (failure_) throw *failure_;
}

void NcclCommunicator::fail(ncclResult_t result, const char* call, const std::string& what) {
  Error error(nccl_status(result), fmt::format("{}: NCCL {} failed on rank {}: {}", what, call,
                                               rank_, nccl_text(result, comm_)));
  abort(error);
  throw error;
}

ncclResult_t NcclCommunicator::wait_while_in_progress(const char* call, const std::string& what) {
  const Deadline deadline(timeout_s_);
  auto next_watch = Clock::now();
  for (unsigned polls = 0;; ++polls) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(comm_, &state);
    if (asked != ncclSuccess) return asked;
    if (state != ncclInProgress) return state;
    if (Clock::now() >= next_watch) {
      try {
        if (watchdog_) watchdog_();
      } catch (const Error& error) {
        abort(error);
        throw;
      }
      next_watch = Clock::now() + std::chrono::milliseconds(1);
    }
    if (deadline.expired()) {
      Error error(Status::kTimeout,
                  fmt::format("{}: NCCL {} did not complete within {} s on rank {} (NCCL "
                              "communicator aborted)",
                              what, call, timeout_s_, rank_));
      abort(error);
      throw error;
    }
    if (polls < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void NcclCommunicator::settle(ncclResult_t result, const char* call, const std::string& what) {
  if (result == ncclInProgress) result = wait_while_in_progress(call, what);
  if (result != ncclSuccess) fail(result, call, what);
}

void NcclCommunicator::check(const std::string& what) {
  throw_if_failed();
  ncclResult_t state = ncclSuccess;
  const ncclResult_t asked = ncclCommGetAsyncError(comm_, &state);
  if (asked != ncclSuccess) fail(asked, "ncclCommGetAsyncError", what);
  if (state == ncclInProgress) state = wait_while_in_progress("operation", what);
  if (state != ncclSuccess) fail(state, "asynchronous operation", what);
}

void NcclCommunicator::allreduce(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype,
                                 ReduceOp op, double prescale, cudaStream_t stream,
                                 const std::string& what) {
  throw_if_failed();
  ncclRedOp_t reduction = nccl_op(op);
  bool created = false;
  if (prescale != 1.0) {
    // NCCL reads the scalar before ncclRedOpCreatePreMulSum returns (ncclScalarHostImmediate).
    double factor = op == ReduceOp::kAvg ? prescale / size_ : prescale;
    float single = static_cast<float>(factor);
    void* scalar =
        dtype == DataType::kFloat64 ? static_cast<void*>(&factor) : static_cast<void*>(&single);
    settle(ncclRedOpCreatePreMulSum(&reduction, scalar, nccl_type(dtype), ncclScalarHostImmediate,
                                    comm_),
           "ncclRedOpCreatePreMulSum", what);
    created = true;
  }
  settle(ncclAllReduce(sendbuf, recvbuf, count, nccl_type(dtype), reduction, comm_, stream),
         "ncclAllReduce", what);
  if (created) settle(ncclRedOpDestroy(reduction, comm_), "ncclRedOpDestroy", what);
}

void NcclCommunicator::broadcast(void* buffer, uint64_t count, DataType dtype, int root,
                                 cudaStream_t stream, const std::string& what) {
  throw_if_failed();
  settle(ncclBroadcast(buffer, buffer, count, nccl_type(dtype), root, comm_, stream),
         "ncclBroadcast", what);
}

void NcclCommunicator::allgather(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype,
                                 cudaStream_t stream, const std::string& what) {
  throw_if_failed();
  settle(ncclAllGather(sendbuf, recvbuf, count, nccl_type(dtype), comm_, stream), "ncclAllGather",
         what);
}

void NcclCommunicator::reduce_scatter(const void* sendbuf, void* recvbuf, uint64_t count,
                                      DataType dtype, ReduceOp op, cudaStream_t stream,
                                      const std::string& what) {
  throw_if_failed();
  settle(ncclReduceScatter(sendbuf, recvbuf, count, nccl_type(dtype), nccl_op(op), comm_, stream),
         "ncclReduceScatter", what);
}

}  // namespace kolo::nccl
