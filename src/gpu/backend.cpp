// The GPU backend of a communicator: start-up, the NCCL path and the staged path. See
// gpu/backend.hpp for the contract; this file holds the CUDA calls.
#include "gpu/backend.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <utility>
#include <vector>

#include "bootstrap/store.hpp"
#include "core/log.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/kernels.hpp"
#include "gpu/wait.hpp"
#include "kolo_build_config.h"
#include "net/socket.hpp"
#include "transport/transport.hpp"
#ifdef KOLO_HAVE_NCCL
#include "gpu/nccl_communicator.hpp"
#endif

namespace kolo::gpu {
namespace {

// How long destroying a backend waits for its own copies to finish before it leaks the staging
// buffer instead of freeing memory that a copy may still use.
constexpr double kDrainOnDestroySeconds = 5.0;

#ifdef KOLO_HAVE_NCCL
constexpr bool kNcclBuilt = true;
#else
constexpr bool kNcclBuilt = false;
#endif

bool is_floating(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat64 ||
         dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
}

cudaStream_t cuda_stream(const Stream* stream) {
  // No stream: the legacy default stream, which every blocking stream synchronises with.
  return stream ? static_cast<cudaStream_t>(stream->handle) : cudaStreamLegacy;
}

// A pinned host buffer that grows to the largest size asked for and is then reused.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { release(); }

  std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }

  // The caller has made sure that no copy still uses the old memory.
  void reserve(size_t bytes) {
    if (bytes <= bytes_) return;
    release();
    const size_t rounded = (bytes + kGrain - 1) / kGrain * kGrain;
    void* memory = nullptr;
    check_cuda(cudaMallocHost(&memory, rounded),
               fmt::format("cudaMallocHost of a {}-byte staging buffer", rounded).c_str());
    data_ = static_cast<std::byte*>(memory);
    bytes_ = rounded;
  }
  void release() noexcept {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  // For a buffer that a copy may still be using: leaked rather than freed.
  void abandon() noexcept {
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  static constexpr size_t kGrain = 2u << 20;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

// ---- Start-up: what every rank publishes, and the decision ------------------------------------

struct DeviceRecord {
  bool ok = true;
  std::string error;  // when !ok
  std::string host;
  std::string bus_id;
  bool nccl_built = false;
  std::string preference;
};

std::string encode(const DeviceRecord& record) {
  if (!record.ok) return "error\n" + record.error;
  return fmt::format("ok\n{}\n{}\n{}\n{}", record.host, record.bus_id, record.nccl_built ? 1 : 0,
                     record.preference);
}

DeviceRecord decode(const std::string& text, int rank) {
  std::vector<std::string> fields;
  size_t start = 0;
  while (fields.size() < 4) {
    const size_t end = text.find('\n', start);
    if (end == std::string::npos) break;
    fields.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  fields.push_back(text.substr(start));
  DeviceRecord record;
  if (!fields.empty() && fields[0] == "error") {
    record.ok = false;
    record.error = text.substr(std::min(text.size(), size_t{6}));
    return record;
  }
  if (fields.size() != 5 || fields[0] != "ok") {
    throw Error(Status::kInternal,
                fmt::format("GPU start-up: rank {} published a malformed record", rank));
  }
  record.host = fields[1];
  record.bus_id = fields[2];
  record.nccl_built = fields[3] == "1";
  record.preference = fields[4];
  return record;
}

DeviceRecord describe_device(int device, const std::string& preference) {
  DeviceRecord record;
  record.host = net::host_name();
  record.nccl_built = kNcclBuilt;
  record.preference = preference;
  char bus_id[64] = {};
  const cudaError_t error = cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    record.ok = false;
    record.error = fmt::format("cudaDeviceGetPCIBusId of device {} failed: {}", device,
                               cuda_error_text(error));
  } else {
    record.bus_id = bus_id;
  }
  return record;
}

// Every rank calls this with the same records and reaches the same decision (or the same error).
Path decide(const std::vector<DeviceRecord>& records) {
  for (size_t rank = 0; rank < records.size(); ++rank) {
    if (!records[rank].ok) {
      throw Error(Status::kSystem,
                  fmt::format("GPU start-up failed on rank {}: {}", rank, records[rank].error));
    }
  }
  const std::string& preference = records[0].preference;
  for (size_t rank = 1; rank < records.size(); ++rank) {
    if (records[rank].preference != preference) {
      throw Error(Status::kConfig,
                  fmt::format("KOLO_GPU_BACKEND is {} on rank 0 but {} on rank {}: set it alike on "
                              "every rank",
                              preference, records[rank].preference, rank));
    }
  }
  if (preference == "staged") return Path::kStaged;

  std::string nccl_problem;
  for (size_t rank = 0; rank < records.size() && nccl_problem.empty(); ++rank) {
    if (!records[rank].nccl_built) {
      nccl_problem = fmt::format("rank {} was built without NCCL", rank);
    }
  }
  std::map<std::pair<std::string, std::string>, size_t> owner;
  for (size_t rank = 0; rank < records.size() && nccl_problem.empty(); ++rank) {
    const auto [it, inserted] =
        owner.emplace(std::pair(records[rank].host, records[rank].bus_id), rank);
    if (!inserted) {
      nccl_problem =
          fmt::format("ranks {} and {} share the GPU {} on {}, and NCCL needs a GPU per rank",
                      it->second, rank, records[rank].bus_id, records[rank].host);
    }
  }
  if (nccl_problem.empty()) return Path::kNccl;
  if (preference == "nccl") {
    throw Error(Status::kUnsupported,
                fmt::format("KOLO_GPU_BACKEND=nccl, but {} (KOLO_GPU_BACKEND=staged or auto stage "
                            "through host memory instead)",
                            nccl_problem));
  }
  log::info("GPU buffers are staged through host memory: {}", nccl_problem);
  return Path::kStaged;
}

}  // namespace

const char* path_name(Path path) {
  switch (path) {
    case Path::kNccl:
      return "nccl";
    case Path::kStaged:
      return "staged";
  }
  return "unknown";
}

// ---- The implementation -------------------------------------------------------------------------

struct Backend::Impl {
  BackendSetup setup;
  int device;
  Path path = Path::kStaged;
  cudaStream_t stream = nullptr;           // the backend's own stream, non-blocking
  cudaEvent_t ready = nullptr;             // recorded on the caller's stream: our work starts after
  cudaEvent_t done = nullptr;              // recorded on our stream after our work
  std::vector<cudaEvent_t> piece_on_host;  // staged: piece i has reached the host
  PinnedBuffer staging;
#ifdef KOLO_HAVE_NCCL
  std::unique_ptr<nccl::NcclCommunicator> nccl;
#endif

  Impl(const BackendSetup& backend_setup, int cuda_device)
      : setup(backend_setup), device(cuda_device) {}

  ~Impl() {
    try {
      DeviceScope scope(device);
#ifdef KOLO_HAVE_NCCL
      // A communicator broken by a lost peer is not finalized (which could wait for the peer):
      // its NCCL communicator is aborted.
      if (const Error* failure = setup.transport->failure()) abort_nccl(*failure);
      nccl.reset();
#endif
      if (stream != nullptr) {
        const Deadline deadline(std::min(setup.timeout_s, kDrainOnDestroySeconds));
        cudaError_t state = cudaStreamQuery(stream);
        while (state == cudaErrorNotReady && !deadline.expired()) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
          state = cudaStreamQuery(stream);
        }
        if (state != cudaSuccess) {
          log::warn(
              "GPU backend destroyed while its copies had not finished ({}); its staging "
              "buffer is leaked rather than freed under them",
              cuda_error_text(state));
          staging.abandon();
        }
      }
      for (cudaEvent_t event : piece_on_host) cudaEventDestroy(event);
      if (ready != nullptr) cudaEventDestroy(ready);
      if (done != nullptr) cudaEventDestroy(done);
      if (stream != nullptr) cudaStreamDestroy(stream);
      staging.release();
      (void)cudaGetLastError();
    } catch (const std::exception& error) {
      log::warn("destroying the GPU backend: {}", error.what());
    }
  }

  void start() {
    // Agree on the path first, so that a rank whose GPU cannot even be described tells the others
    // (through its record) instead of leaving them to time out.
    const DeviceRecord mine = describe_device(device, setup.preference);
    StoreClient& store = *setup.store;
    store.set_string(fmt::format("{}/device/{}", setup.key_prefix, setup.rank), encode(mine));
    if (!mine.ok) throw Error(Status::kSystem, mine.error);
    std::vector<DeviceRecord> records(static_cast<size_t>(setup.size));
    for (int rank = 0; rank < setup.size; ++rank) {
      records[static_cast<size_t>(rank)] =
          rank == setup.rank
              ? mine
              : decode(store.get_string(fmt::format("{}/device/{}", setup.key_prefix, rank)), rank);
    }
    path = decide(records);

    DeviceScope scope(device);
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    ready = new_event();
    done = new_event();
#ifdef KOLO_HAVE_NCCL
    if (path == Path::kNccl) {
      Transport* transport = setup.transport;
      nccl = std::make_unique<nccl::NcclCommunicator>(
          store, setup.key_prefix, setup.rank, setup.size, device, setup.timeout_s,
          [transport] { transport->progress(Deadline(0.0)); });
    }
#endif
    log::info("GPU collectives on CUDA device {} ({}): {}", device, mine.bus_id, path_name(path));
  }

  cudaEvent_t new_event() {
    cudaEvent_t event = nullptr;
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    return event;
  }

  // On every failure the NCCL communicator is aborted before the error goes on: no kernel may be
  // left waiting for a peer that will never come.
  template <typename Body>
  void guarded(Body&& body) {
    try {
      body();
    } catch (const Error& error) {
      abort_nccl(error);
      throw;
    } catch (const std::exception& error) {
      abort_nccl(Error(Status::kInternal, error.what()));
      throw;
    }
  }

  void abort_nccl([[maybe_unused]] const Error& error) noexcept {
#ifdef KOLO_HAVE_NCCL
    if (nccl) nccl->abort(error);
#endif
  }

  // Between polls of a wait: NCCL's asynchronous error, and kolo's transport (a lost peer, an
  // ABORT from another rank) without blocking.
  void watch([[maybe_unused]] const std::string& what) {
#ifdef KOLO_HAVE_NCCL
    if (nccl) nccl->check(what);
#endif
    setup.transport->progress(Deadline(0.0));
  }

  void wait_event(cudaEvent_t event, const std::string& what) {
    wait_until_ready([event] { return cudaEventQuery(event); }, [&] { watch(what); },
                     setup.timeout_s, what);
  }

  // Our stream starts after what the caller has enqueued on its stream so far.
  void start_after(cudaStream_t caller) {
    check_cuda(cudaEventRecord(ready, caller), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream, ready, 0), "cudaStreamWaitEvent");
  }

  // With a stream, the caller's stream waits for our work; without, we wait for it here.
  void end(const Stream* caller, const std::string& what) {
    check_cuda(cudaEventRecord(done, stream), "cudaEventRecord");
    if (caller != nullptr) {
      check_cuda(cudaStreamWaitEvent(cuda_stream(caller), done, 0), "cudaStreamWaitEvent");
    } else {
      wait_event(done, what);
    }
  }

  // ---- NCCL -------------------------------------------------------------------------------------

#ifdef KOLO_HAVE_NCCL
  void nccl_allreduce(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                      const Stream* caller, const std::string& what) {
    nccl->check(what);
    cudaStream_t work = caller ? cuda_stream(caller) : stream;
    if (caller == nullptr) start_after(cudaStreamLegacy);
    // NCCL's AVG of integers is not kolo's (sum, then divide truncating): sum, then divide here.
    ReduceOp base = op.op;
    int divisor = 1;
    if (!is_floating(op.dtype) && op.op == ReduceOp::kAvg) {
      base = ReduceOp::kSum;
      divisor = setup.size;
    }
    // A pre-multiplying sum where NCCL's arithmetic is kolo's (float32 and float64 SUM and AVG);
    // otherwise the device scales the input into recvbuf and NCCL reduces that in place.
    double nccl_prescale = 1.0;
    const void* source = sendbuf;
    if (op.prescale != 1.0) {
      const bool premultiply = (op.dtype == DataType::kFloat32 || op.dtype == DataType::kFloat64) &&
                               (base == ReduceOp::kSum || base == ReduceOp::kAvg);
      if (premultiply) {
        nccl_prescale = op.prescale;
      } else {
        scale(sendbuf, recvbuf, op.count, op.dtype, op.prescale, Stream{work});
        source = recvbuf;
      }
    }
    nccl->allreduce(source, recvbuf, op.count, op.dtype, base, nccl_prescale, work, what);
    finish_reduction(recvbuf, op.count, op.dtype, divisor, op.postscale, Stream{work});
    if (caller == nullptr) end(nullptr, what);
  }

  void nccl_allgather(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                      const Stream* caller, const std::string& what) {
    nccl->check(what);
    cudaStream_t work = caller ? cuda_stream(caller) : stream;
    if (caller == nullptr) start_after(cudaStreamLegacy);
    nccl->allgather(sendbuf, recvbuf, op.count, op.dtype, work, what);
    if (caller == nullptr) end(nullptr, what);
  }

  void nccl_reduce_scatter(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                           const Stream* caller, const std::string& what) {
    nccl->check(what);
    cudaStream_t work = caller ? cuda_stream(caller) : stream;
    if (caller == nullptr) start_after(cudaStreamLegacy);
    // As for allreduce: kolo's integer AVG is a sum divided afterwards, truncating.
    const bool integer_average = !is_floating(op.dtype) && op.op == ReduceOp::kAvg;
    nccl->reduce_scatter(sendbuf, recvbuf, op.count, op.dtype,
                         integer_average ? ReduceOp::kSum : op.op, work, what);
    if (integer_average) {
      finish_reduction(recvbuf, op.count, op.dtype, setup.size, 1.0, Stream{work});
    }
    if (caller == nullptr) end(nullptr, what);
  }

  void nccl_broadcast(const OpDescriptor& op, void* buffer, const Stream* caller,
                      const std::string& what) {
    nccl->check(what);
    cudaStream_t work = caller ? cuda_stream(caller) : stream;
    if (caller == nullptr) start_after(cudaStreamLegacy);
    nccl->broadcast(buffer, op.count, op.dtype, op.root, work, what);
    if (caller == nullptr) end(nullptr, what);
  }
#endif

  // ---- Staged -----------------------------------------------------------------------------------

  struct Piece {
    uint64_t first = 0;  // element offset
    uint64_t count = 0;
  };

  // Pieces of kStagingPieceBytes (whole elements), a staging buffer large enough, and an event per
  // piece.
  void reserve_staging(uint64_t bytes, const std::string& what) {
    if (staging.bytes() >= bytes) return;
    // The old buffer may move: no copy of an earlier call may still use it.
    check_cuda(cudaEventRecord(done, stream), "cudaEventRecord");
    wait_event(done, what);
    staging.reserve(bytes);
  }

  std::vector<Piece> prepare_staging(const OpDescriptor& op, const std::string& what) {
    const size_t element = dtype_size(op.dtype);
    reserve_staging(op.count * element, what);
    const uint64_t per_piece = std::max<uint64_t>(1, kStagingPieceBytes / element);
    std::vector<Piece> pieces;
    for (uint64_t first = 0; first < op.count; first += per_piece) {
      pieces.push_back({first, std::min(per_piece, op.count - first)});
    }
    while (piece_on_host.size() < pieces.size()) piece_on_host.push_back(new_event());
    return pieces;
  }

  void copy_to_host(const std::vector<Piece>& pieces, const void* device_buffer, size_t element) {
    for (size_t i = 0; i < pieces.size(); ++i) {
      const size_t offset = pieces[i].first * element;
      check_cuda(cudaMemcpyAsync(staging.data() + offset,
                                 static_cast<const std::byte*>(device_buffer) + offset,
                                 pieces[i].count * element, cudaMemcpyDeviceToHost, stream),
                 "cudaMemcpyAsync (device to pinned host)");
      check_cuda(cudaEventRecord(piece_on_host[i], stream), "cudaEventRecord");
    }
  }

  void copy_to_device(const Piece& piece, void* device_buffer, size_t element) {
    const size_t offset = piece.first * element;
    check_cuda(
        cudaMemcpyAsync(static_cast<std::byte*>(device_buffer) + offset, staging.data() + offset,
                        piece.count * element, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync (pinned host to device)");
  }

  void staged_allreduce(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                        const Stream* caller, const HostAllreduce& host, const std::string& what) {
    const size_t element = dtype_size(op.dtype);
    start_after(cuda_stream(caller));
    const std::vector<Piece> pieces = prepare_staging(op, what);
    copy_to_host(pieces, sendbuf, element);
    for (size_t i = 0; i < pieces.size(); ++i) {
      wait_event(piece_on_host[i], what);
      OpDescriptor piece = op;
      piece.count = pieces[i].count;
      std::byte* data = staging.data() + pieces[i].first * element;
      host(piece, data, data);
      copy_to_device(pieces[i], recvbuf, element);
    }
    end(caller, what);
  }

  // The whole buffers at once, for the collectives whose blocks do not cut into pieces simply
  // (allgather, reduce-scatter): sendbuf to the host, the host collective out of place, the result
  // back. The staging buffer holds the result first, then (256-byte aligned) the input.
  void staged_whole(const void* sendbuf, uint64_t send_bytes, void* recvbuf, uint64_t recv_bytes,
                    const Stream* caller, const HostCollective& host, const std::string& what) {
    start_after(cuda_stream(caller));
    const uint64_t input_offset = (recv_bytes + 255) / 256 * 256;
    reserve_staging(input_offset + send_bytes, what);
    std::byte* host_recv = staging.data();
    std::byte* host_send = staging.data() + input_offset;
    check_cuda(cudaMemcpyAsync(host_send, sendbuf, send_bytes, cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync (device to pinned host)");
    check_cuda(cudaEventRecord(done, stream), "cudaEventRecord");
    wait_event(done, what);
    host(host_send, host_recv);
    check_cuda(cudaMemcpyAsync(recvbuf, host_recv, recv_bytes, cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync (pinned host to device)");
    end(caller, what);
  }

  void staged_broadcast(const OpDescriptor& op, void* buffer, const Stream* caller,
                        const HostBroadcast& host, const std::string& what) {
    const size_t element = dtype_size(op.dtype);
    const bool root = op.root == setup.rank;
    start_after(cuda_stream(caller));
    const std::vector<Piece> pieces = prepare_staging(op, what);
    if (root) copy_to_host(pieces, buffer, element);
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (root) wait_event(piece_on_host[i], what);
      OpDescriptor piece = op;
      piece.count = pieces[i].count;
      host(piece, staging.data() + pieces[i].first * element);
      if (!root) copy_to_device(pieces[i], buffer, element);
    }
    end(caller, what);
  }
};

// ---- Backend ------------------------------------------------------------------------------------

Backend::Backend(const BackendSetup& setup, int device)
    : impl_(std::make_unique<Impl>(setup, device)) {
  impl_->guarded([&] { impl_->start(); });
}

Backend::~Backend() = default;

Path Backend::path() const {
  return impl_->path;
}
int Backend::device() const {
  return impl_->device;
}

void Backend::allreduce(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                        const Stream* stream, const HostAllreduce& host) {
  if (op.count == 0) return;
  impl_->guarded([&] {
    DeviceScope scope(impl_->device);
    const std::string what = describe(op);
#ifdef KOLO_HAVE_NCCL
    if (impl_->path == Path::kNccl) {
      impl_->nccl_allreduce(op, sendbuf, recvbuf, stream, what);
      return;
    }
#endif
    impl_->staged_allreduce(op, sendbuf, recvbuf, stream, host, what);
  });
}

void Backend::broadcast(const OpDescriptor& op, void* buffer, const Stream* stream,
                        const HostBroadcast& host) {
  if (op.count == 0) return;
  impl_->guarded([&] {
    DeviceScope scope(impl_->device);
    const std::string what = describe(op);
#ifdef KOLO_HAVE_NCCL
    if (impl_->path == Path::kNccl) {
      impl_->nccl_broadcast(op, buffer, stream, what);
      return;
    }
#endif
    impl_->staged_broadcast(op, buffer, stream, host, what);
  });
}

void Backend::allgather(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                        const Stream* stream, const HostCollective& host) {
  if (op.count == 0) return;
  impl_->guarded([&] {
    DeviceScope scope(impl_->device);
    const std::string what = describe(op);
#ifdef KOLO_HAVE_NCCL
    if (impl_->path == Path::kNccl) {
      impl_->nccl_allgather(op, sendbuf, recvbuf, stream, what);
      return;
    }
#endif
    const uint64_t bytes = op.count * dtype_size(op.dtype);
    impl_->staged_whole(sendbuf, bytes, recvbuf, bytes * static_cast<uint64_t>(impl_->setup.size),
                        stream, host, what);
  });
}

void Backend::reduce_scatter(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                             const Stream* stream, const HostCollective& host) {
  if (op.count == 0) return;
  impl_->guarded([&] {
    DeviceScope scope(impl_->device);
    const std::string what = describe(op);
#ifdef KOLO_HAVE_NCCL
    if (impl_->path == Path::kNccl) {
      impl_->nccl_reduce_scatter(op, sendbuf, recvbuf, stream, what);
      return;
    }
#endif
    const uint64_t bytes = op.count * dtype_size(op.dtype);
    impl_->staged_whole(sendbuf, bytes * static_cast<uint64_t>(impl_->setup.size), recvbuf, bytes,
                        stream, host, what);
  });
}

void Backend::synchronize(Stream stream, const std::string& what) {
  impl_->guarded([&] {
    DeviceScope scope(impl_->device);
    const auto cuda = static_cast<cudaStream_t>(stream.handle);
    wait_until_ready([cuda] { return cudaStreamQuery(cuda); }, [&] { impl_->watch(what); },
                     impl_->setup.timeout_s, what);
    impl_->watch(what);
  });
}

void wait_for_stream(Stream stream, double timeout_s, const std::string& what) {
  const auto cuda = static_cast<cudaStream_t>(stream.handle);
  wait_until_ready([cuda] { return cudaStreamQuery(cuda); }, [] {}, timeout_s, what);
}

}  // namespace kolo::gpu
