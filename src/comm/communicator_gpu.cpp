// The GPU side of Communicator: buffers in device memory go to the communicator's gpu::Backend
// (gpu/backend.hpp), created by the first GPU collective on the device of its buffers. Argument
// errors particular to GPU buffers (host memory where a stream needs device memory, buffers on two
// devices, a device other than the communicator's, no GPU at all) are found here, before anything
// is sent, and leave the communicator usable; everything later breaks it as any collective's
// failure does.
#include <fmt/format.h>

#include "bootstrap/store.hpp"
#include "comm/communicator.hpp"
#include "gpu/backend.hpp"
#include "gpu/gpu.hpp"
#include "ring/ring.hpp"
#include "transport/transport.hpp"

namespace kolo {

int Communicator::gpu_device_of(const char* what, const void* first, const char* first_name,
                                const void* second, const char* second_name, uint64_t count,
                                const gpu::Stream* stream) const {
  if (!gpu::devices_present()) {
    throw Error(Status::kUnsupported, fmt::format("{} on a CUDA stream: no GPU ({})", what,
                                                  gpu::devices_absent_reason()));
  }
  if (count == 0) return -1;
  int device = -1;
  for (const auto& [buffer, name] :
       {std::pair(first, first_name), std::pair(second, second_name)}) {
    if (name == nullptr) continue;
    const gpu::MemoryLocation location = gpu::locate(buffer);
    if (!location.device) {
      throw Error(Status::kInvalidArgument,
                  fmt::format("{}: {} is in host memory, but {} (rank {})", what, name,
                              stream ? "a call on a CUDA stream needs device memory"
                                     : "the other buffer is in device memory",
                              rank()));
    }
    if (device >= 0 && location.ordinal != device) {
      throw Error(Status::kInvalidArgument,
                  fmt::format("{}: {} is on CUDA device {} and {} on device {} (rank {})", what,
                              first_name, device, name, location.ordinal, rank()));
    }
    device = location.ordinal;
  }
  const int bound = gpu_device_.load(std::memory_order_acquire);
  if (bound >= 0 && device != bound) {
    throw Error(Status::kInvalidArgument,
                fmt::format("{}: the buffers are on CUDA device {}, but this communicator works "
                            "on device {}, where its first GPU collective ran (rank {})",
                            what, device, bound, rank()));
  }
  return device;
}

gpu::Backend& Communicator::gpu_backend(int device) {
  if (!gpu_) {
    gpu::BackendSetup setup;
    setup.store = store_.get();
    setup.transport = transport_.get();
    setup.key_prefix = store_key(context_, "gpu");
    setup.rank = rank();
    setup.size = size();
    setup.timeout_s = config_.timeout_s;
    setup.preference = config_.gpu_backend;
    gpu_ = std::make_unique<gpu::Backend>(setup, device);
    gpu_device_.store(device, std::memory_order_release);
  }
  return *gpu_;
}

void Communicator::gpu_allreduce(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                                 const gpu::Stream* stream) {
  gpu::check_device_dtype(op.dtype, "allreduce", rank());
  const int device =
      gpu_device_of("allreduce", sendbuf, "sendbuf", recvbuf, "recvbuf", op.count, stream);
  run_collective(op, [&](const OpDescriptor& d) {
    if (d.count == 0) return;
    // The staged path runs kolo's host allreduce on each piece, its schedule chosen for the
    // piece's size by the same dispatcher as every host allreduce.
    auto host = [&](OpDescriptor piece, const void* send, void* recv) {
      run_allreduce(*ring_, piece, send, recv);
    };
    gpu_backend(device).allreduce(d, sendbuf, recvbuf, stream, host);
  });
}

void Communicator::gpu_broadcast(const OpDescriptor& op, void* buffer, const gpu::Stream* stream) {
  gpu::check_device_dtype(op.dtype, "broadcast", rank());
  const int device = gpu_device_of("broadcast", buffer, "buf", nullptr, nullptr, op.count, stream);
  run_collective(op, [&](const OpDescriptor& d) {
    if (d.count == 0) return;
    auto host = [&](OpDescriptor piece, void* data) { ring_broadcast(*ring_, piece, data); };
    gpu_backend(device).broadcast(d, buffer, stream, host);
  });
}

void Communicator::gpu_allgather(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                                 const Blocks& blocks) {
  gpu::check_device_dtype(op.dtype, "allgather", rank());
  const int device = gpu_device_of("allgather", sendbuf, "sendbuf", recvbuf, "recvbuf",
                                   op.count, nullptr);
  run_collective(op, [&](const OpDescriptor& d) {
    if (d.count == 0) return;
    // The staged path runs the host allgather on the whole staged buffers, out of place.
    auto host = [&](const void* send, void* recv) {
      allgather_blocks(*ring_, d, send, recv, blocks);
    };
    gpu_backend(device).allgather(d, sendbuf, recvbuf, nullptr, host);
  });
}

void Communicator::gpu_reduce_scatter(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                                      const Blocks& blocks) {
  gpu::check_device_dtype(op.dtype, "reduce_scatter", rank());
  const int device = gpu_device_of("reduce_scatter", sendbuf, "sendbuf", recvbuf, "recvbuf",
                                   op.count, nullptr);
  run_collective(op, [&](const OpDescriptor& d) {
    if (d.count == 0) return;
    auto host = [&](const void* send, void* recv) {
      ring_reduce_scatter(*ring_, d, send, recv, blocks);
    };
    gpu_backend(device).reduce_scatter(d, sendbuf, recvbuf, nullptr, host);
  });
}

void Communicator::synchronize_stream(const gpu::Stream& stream) {
  if (!gpu::devices_present()) {
    throw Error(Status::kUnsupported, fmt::format("synchronizing a CUDA stream: no GPU ({})",
                                                  gpu::devices_absent_reason()));
  }
  // No sequence number: nothing is sent. Failures break the communicator as a collective's do.
  OpDescriptor descriptor;
  descriptor.collective = Collective::kBarrier;
  run_point_to_point(descriptor, [&](const OpDescriptor&) {
    const std::string what = fmt::format("synchronizing a CUDA stream (rank {})", rank());
    if (gpu_) {
      gpu_->synchronize(stream, what);
    } else {
      gpu::wait_for_stream(stream, config_.timeout_s, what);
    }
  });
}

const char* Communicator::gpu_path() {
  std::lock_guard<std::mutex> lock(mutex_);
  return gpu_ ? gpu::path_name(gpu_->path()) : "none";
}

}  // namespace kolo
