// The GPU side of one communicator: collectives on buffers in device memory. No CUDA header is
// needed to include this file; the implementation is gpu/backend.cpp (gpu/unavailable.cpp in a
// build without CUDA, where constructing one throws KOLO_ERR_UNSUPPORTED).
//
// Two paths, chosen once for the communicator, identically on every rank:
//   nccl     NCCL runs the collective (gpu/nccl_communicator.*). Needs kolo built with NCCL and a
//            GPU per rank: NCCL refuses two ranks on one device.
//   staged   device -> pinned host memory -> kolo's own host collective (the ring over TCP or UCX)
//            -> device. Works everywhere, several ranks sharing one GPU included.
// KOLO_GPU_BACKEND=auto (the default) takes nccl where it can and staged otherwise; nccl or
// staged force one (nccl fails with KOLO_ERR_UNSUPPORTED where it cannot run).
//
// Start-up happens in the first GPU collective, which every rank calls in the same order: each
// rank publishes in the store "<host> <PCI bus id of its device> <NCCL built?> <preference>",
// reads everyone's, and all reach the same decision (rank 0's preference wins; ranks that prefer
// differently are a KOLO_ERR_CONFIG). Then the NCCL communicator, if any, is created through the
// store (nccl_communicator.hpp).
//
// Ordering. A call with a stream is stream-ordered, as NCCL's are: it starts after the work
// already enqueued on that stream, and work enqueued after it sees its result. On the NCCL path it
// only enqueues and returns; on the staged path it returns once the network part is done, with the
// copy back to the device enqueued (the stream waits for it). A call without a stream behaves as
// if issued on the legacy default stream and waited for: it starts after the work on the legacy
// default stream (and so on every blocking stream) and returns when the result is in place.
//
// Staging. The pinned host buffer is allocated once (cudaMallocHost) and grows to the largest call.
// A buffer is staged in pieces of kStagingPieceBytes: every piece's device-to-host copy is enqueued
// at once on the backend's own stream, each followed by an event; the host collective of piece i
// starts when its event has fired and overlaps the copies of the pieces after it, and the copy back
// of piece i is enqueued as soon as its collective is done, overlapping the collective of piece
// i + 1. Every piece is its own host collective (same sequence number, the piece's count), so ranks
// that disagree still see KOLO_ERR_MISMATCH.
//
// Waiting. Every wait is bounded by the communicator's timeout and watches, about every
// millisecond, NCCL's asynchronous error and kolo's own transport (a lost peer or an ABORT from
// another rank). On any failure the NCCL communicator is aborted first, so that no kernel is left
// waiting for a dead peer, and the error goes on to the communicator, which breaks as for any
// other failure.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/op_descriptor.hpp"
#include "gpu/gpu.hpp"

namespace kolo {

class StoreClient;
class Transport;

namespace gpu {

inline constexpr uint64_t kStagingPieceBytes = 8u << 20;

enum class Path { kNccl, kStaged };
const char* path_name(Path path);  // "nccl", "staged"

// The host collective of the staged path, run on pinned host memory for one piece: the
// communicator fills in what the descriptor leaves open (the algorithm for the piece's size).
using HostAllreduce = std::function<void(OpDescriptor piece, const void* sendbuf, void* recvbuf)>;
using HostBroadcast = std::function<void(OpDescriptor piece, void* buffer)>;
// The host collective of the staged path on whole buffers (allgather, reduce-scatter).
using HostCollective = std::function<void(const void* sendbuf, void* recvbuf)>;

struct BackendSetup {
  StoreClient* store = nullptr;
  Transport* transport = nullptr;
  std::string key_prefix;  // store keys of this communicator's GPU start-up
  int rank = 0;
  int size = 1;
  double timeout_s = 300.0;
  std::string preference = "auto";  // KOLO_GPU_BACKEND: auto | nccl | staged
};

class Backend {
 public:
  // Collective (see above); device is this rank's CUDA device, the one its buffers are on.
  Backend(const BackendSetup& setup, int device);
  ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  Path path() const;
  int device() const;

  // The collectives; op has been validated and numbered by the communicator, and every buffer
  // with count > 0 is device memory on device(). stream == nullptr: no stream (see above).
  void allreduce(const OpDescriptor& op, const void* sendbuf, void* recvbuf, const Stream* stream,
                 const HostAllreduce& host);
  void broadcast(const OpDescriptor& op, void* buffer, const Stream* stream,
                 const HostBroadcast& host);
  // op.count elements per rank: allgather reads op.count and writes size * op.count elements,
  // reduce-scatter the other way round; in place as the host calls define it. The staged path
  // stages them whole, without pieces.
  void allgather(const OpDescriptor& op, const void* sendbuf, void* recvbuf, const Stream* stream,
                 const HostCollective& host);
  void reduce_scatter(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                      const Stream* stream, const HostCollective& host);

  // Waits until the work enqueued on stream so far has finished, watching for failures as the
  // collectives do.
  void synchronize(Stream stream, const std::string& what);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Waits until the work enqueued on stream so far has finished, no longer than timeout_s (for a
// communicator that has no Backend yet). Throws kolo::Error.
void wait_for_stream(Stream stream, double timeout_s, const std::string& what);

}  // namespace gpu
}  // namespace kolo
