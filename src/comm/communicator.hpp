// A communicator: a group of ranks, their connections, and the collectives they run together.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/deadline.hpp"
#include "core/op_descriptor.hpp"
#include "gpu/backend.hpp"  // no CUDA header: the GPU backend's interface only
#include "kolo/dtype.hpp"
#include "kolo/status.hpp"

namespace kolo {

namespace net {
class Socket;
}
struct PreparedMesh;
class StoreServer;
class ReservedStore;
class StoreClient;
class Lifeline;
struct GrowthOffer;
class Transport;
class Ring;
struct Blocks;
namespace fusion {
class FusionEngine;
}

// What every rank's KOLO_ALLREDUCE and host identity say (in rank order), seen from `rank`: host
// numbers in rank order (shared by the ranks of one host), this rank's local rank and size, the
// node count, and the first rank whose KOLO_ALLREDUCE differs from rank 0's (-1: none).
struct HostFacts {
  std::vector<int> host_of;
  int local_rank = 0;
  int local_size = 0;
  int nodes = 0;
  int differs = -1;
};
HostFacts read_host_facts(const std::vector<std::string>& modes,
                          const std::vector<std::string>& identities, int rank);

class Communicator {
 public:
  // Joins the job described by the overrides and the environment (see core/config.hpp): rank 0
  // serves the rendezvous store, every rank publishes its address and connects to every peer.
  // Blocks until all ranks have joined or the timeout passes; throws kolo::Error.
  explicit Communicator(const ConfigOverrides& overrides);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return config_.rank; }
  int size() const { return config_.size; }
  int local_rank() const { return config_.local_rank; }
  int local_size() const { return config_.local_size; }
  int node_count() const { return node_count_; }
  // What tells this communicator's store keys and connections apart from every other's: the
  // world's is 1, a split's follows from its parent's (comm/split.cpp).
  uint64_t context() const { return context_; }
  const Config& config() const { return config_; }

  // Collectives. Each validates its arguments first (kolo::Error(kInvalidArgument), nothing sent,
  // the communicator stays usable). Any later failure breaks the communicator: this and every
  // following call throw the same error. Calls from several threads are serialised.
  // Buffers in device memory take the GPU path (gpu/backend.hpp); a stream makes the call
  // stream-ordered (kolo_allreduce_on_stream), and then the buffers must be in device memory.
  void allreduce(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype, ReduceOp op,
                 double prescale = 1.0, double postscale = 1.0,
                 const gpu::Stream* stream = nullptr);
  void broadcast(void* buffer, uint64_t count, DataType dtype, int root,
                 const gpu::Stream* stream = nullptr);
  void barrier();

  // The rest of the collective set (comm/collectives.cpp; capi/kolo.h documents each). Counts and
  // displacements are in elements; a span of counts holds one entry per rank.
  void allgather(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype);
  void allgatherv(const void* sendbuf, void* recvbuf, std::span<const uint64_t> counts,
                  DataType dtype);
  void reduce_scatter(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype,
                      ReduceOp op);
  void reduce_scatterv(const void* sendbuf, void* recvbuf, std::span<const uint64_t> counts,
                       DataType dtype, ReduceOp op);
  void alltoall(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype);
  void alltoallv(const void* sendbuf, std::span<const uint64_t> send_counts,
                 std::span<const int64_t> send_displacements, void* recvbuf,
                 std::span<const uint64_t> recv_counts, std::span<const int64_t> recv_displacements,
                 DataType dtype);
  void reduce(const void* sendbuf, void* recvbuf, uint64_t count, DataType dtype, ReduceOp op,
              int root);
  // Point to point (comm/collectives.cpp): blocking, matched in order per pair of ranks.
  void send(const void* buffer, uint64_t count, DataType dtype, int peer, int tag);
  void recv(void* buffer, uint64_t count, DataType dtype, int peer, int tag);

  // Collective on this communicator (comm/split.cpp): ranks with the same colour form a new
  // communicator, ordered by (key, rank here). A negative colour returns nullptr. The new one has
  // its own connections, lock and sequence numbers, and outlives this one if need be.
  std::unique_ptr<Communicator> split(int color, int key);

  // Called by every surviving rank after a rank was lost (comm/shrink.cpp, comm/lifeline.hpp;
  // capi/kolo.h's kolo_comm_shrink states the contract): breaks this communicator on every rank
  // if it was not broken, agrees with the other survivors on who they are, and returns a new
  // communicator of exactly them, ranked in their order here. Throws kolo::Error.
  std::unique_ptr<Communicator> shrink();

  // Growth (comm/grow.cpp; capi/kolo.h's kolo_comm_invite and kolo_comm_grow state the contract).
  // invite(), on rank 0 only: the invitation text for newcomers (KOLO_INVITATION), valid for the
  // next grow() and replacing any earlier one. grow(), collective on this communicator: with the
  // newcomers holding the invitation, forms a communicator of new_size ranks, this one's first in
  // their order, and breaks this one. Both throw kolo::Error.
  std::string invite();
  std::unique_ptr<Communicator> grow(int new_size);

  // The fusion engine of this communicator, for named asynchronous operations (src/fusion/):
  // created on first use, its thread and connections start with the first submission. It fails
  // its requests when this communicator breaks, and is stopped first when it is destroyed.
  fusion::FusionEngine& fusion();

  // GPU buffers (comm/communicator_gpu.cpp). Waits, bounded by the timeout, until the work
  // enqueued on stream so far has finished; a failure seen meanwhile (NCCL's, a lost peer) breaks
  // the communicator as a failed collective does.
  void synchronize_stream(const gpu::Stream& stream);
  // "nccl" or "staged" once the first GPU collective has chosen (gpu/backend.hpp), else "none".
  const char* gpu_path();

  // What this rank is doing on this communicator, in one line (comm/report.hpp): the collective
  // it is in, for how long and which peer it waits for, or the last one it finished; then the
  // fusion engine's report. Safe from any thread while calls run.
  std::string report();

 private:
  // A member of a split (comm/split.cpp) or a shrink (comm/shrink.cpp): connects to its fellow
  // members through the store config.addr names.
  // host_of[rank] numbers the host of every member (equal numbers: one host).
  Communicator(const Config& config, std::shared_ptr<StoreServer> server, uint64_t context,
               const std::vector<int>& host_of);

  // What a member of a split, shrink or growth does to connect, with config_, context_ and
  // host_of_ set: opens the store config_.addr names, agrees where each member listens, connects
  // the transport, ring and lifeline, and places the allreduce. Collective over the members.
  void connect_members();

  // The public constructor's way for a newcomer (config_.invitation set; comm/grow.cpp): joins
  // the growth the invitation names and connects as the rank it is given there.
  void join_growth();

  // Runs one call under the lock, numbering it (unless told not to) and breaking the
  // communicator if it fails.
  template <typename Body>
  void run(OpDescriptor op, Body&& body, bool numbered = true);
  // run(), for the collectives defined in other files.
  void run_collective(const OpDescriptor& op, const std::function<void(const OpDescriptor&)>& body);
  // As run(), without taking a collective sequence number (point to point numbers its messages
  // per pair of ranks).
  void run_point_to_point(const OpDescriptor& op,
                          const std::function<void(const OpDescriptor&)>& body);
  // The world communicator's start-up through the store (kolorun, torchrun, a plain environment):
  // the transport's and lifeline's listeners first, then one SET of this rank's whole record and
  // one GET_MANY of every other rank's, then connect (comm/communicator.cpp). Sets the local rank
  // and size where the launcher did not, the node count and host_of_; throws kolo::Error(kConfig)
  // on every rank when the ranks' KOLO_ALLREDUCE differ.
  void start_through_store();
  // One SET of this rank's start-up record and one GET_MANY of every other rank's under the
  // world's "host" keys, in rank order with this rank's own; a rank whose record never comes is
  // named (KOLO_ERR_TIMEOUT, or KOLO_ERR_PEER_LOST where rank 0's store closed first).
  std::vector<std::string> gather_records(const std::string& mine);
  // KOLO_ALLREDUCE differs between ranks (facts.differs): every rank says it is done reading and
  // rank 0, whose process serves the store, waits for that before every rank throws.
  void refuse_modes(const std::vector<std::string>& modes, const HostFacts& facts);
  // The world communicator's start-up under PMIx (bootstrap/pmix.hpp): listeners first, one
  // record per rank through one PMIx fence, then connect; no store serves until one is needed.
  void start_through_pmix();
  // The end of both start-ups: binds the process (KOLO_BIND), connects the world's transport and
  // ring from `prepared` (listening on `host`), and starts the lifeline on `lifeline_listener`
  // with every rank's lifeline address (`lifeline_host`: as Lifeline takes it).
  void connect_world(const std::string& host, const std::shared_ptr<PreparedMesh>& prepared,
                     net::Socket lifeline_listener, const std::vector<std::string>& lifelines,
                     const std::string& lifeline_host);
  // Takes the host numbers, node count and (where the launcher gave none) local rank and size.
  void take_host_facts(const HostFacts& facts);
  // The collective run() started (running) or finished, for report().
  void start_activity(const OpDescriptor& op);
  void end_activity(bool failed);
  // Hands KOLO_ALLREDUCE and the host map to the allreduce dispatcher (ring/algorithms.hpp);
  // returns the schedules it chose, in words ("flat", "hierarchical up to N bytes, flat above").
  std::string place_allreduce();
  // The communicator broke: the fusion engine fails its requests too.
  void tell_fusion_engine(const Error& error);
  // The GPU path of allreduce() and broadcast() (comm/communicator_gpu.cpp), and the backend that
  // the first GPU collective creates, under mutex_, on the device of its buffers.
  void gpu_allreduce(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                     const gpu::Stream* stream);
  void gpu_broadcast(const OpDescriptor& op, void* buffer, const gpu::Stream* stream);
  // allgather() and reduce_scatter() on device buffers (blocking calls; blocks of equal counts).
  void gpu_allgather(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                     const Blocks& blocks);
  void gpu_reduce_scatter(const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                          const Blocks& blocks);
  int gpu_device_of(const char* what, const void* first, const char* first_name, const void* second,
                    const char* second_name, uint64_t count, const gpu::Stream* stream) const;
  gpu::Backend& gpu_backend(int device);

  Config config_;
  int node_count_ = 1;
  std::vector<int> host_of_;             // per rank: a number shared by the ranks of one host
  std::shared_ptr<StoreServer> server_;  // shared with the sub-communicators of this process
  // Under PMIx, world rank 0's store port, bound and served from its first use (comm/connect.hpp).
  std::shared_ptr<ReservedStore> reserved_store_;
  std::unique_ptr<StoreClient> store_;
  // The store keys this rank wrote while a split or shrink connected it (the private
  // constructor): a finished split erases them (comm/split.cpp).
  std::vector<std::string> connect_keys_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Ring> ring_;
  std::shared_ptr<Lifeline> lifeline_;  // where the survivors meet if a rank is lost
  // For a communicator from shrink(): the lifeline it was shrunk from, kept listening so that a
  // survivor that comes too late waits there and fails, rather than finding every rank before it
  // gone and forming a communicator of its own.
  std::shared_ptr<Lifeline> predecessor_;
  std::shared_ptr<GrowthOffer> offer_;  // under mutex_: rank 0's latest invitation (comm/grow.cpp)
  std::mutex mutex_;
  uint64_t sequence_ = 0;
  bool warned_concurrent_ = false;  // under mutex_: the warning of run() is given once
  std::optional<Error> broken_;
  uint64_t context_ = 1;  // tells this communicator's connections and store keys apart; 1: world
  std::vector<uint64_t> messages_sent_;      // point to point, per peer
  std::vector<uint64_t> messages_received_;  // point to point, per peer
  // What report() says. A collective's start takes activity_mutex_ (never held while waiting) to
  // record it; its end only stores the atomics (no clock: an 8-byte allreduce notices a read).
  struct Activity {
    std::optional<OpDescriptor> op;  // the last collective run() started; under activity_mutex_
    CoarseClock::time_point started{};  // under activity_mutex_
    std::atomic<bool> running{false};
    std::atomic<bool> failed{false};
  };
  std::mutex activity_mutex_;
  Activity activity_;
  std::mutex fusion_mutex_;                       // guards the two below
  std::shared_ptr<fusion::FusionEngine> fusion_;  // see fusion()
  std::optional<Error> fusion_failure_;           // why this communicator broke, for the engine
  std::atomic<int> gpu_device_{-1};               // the CUDA device of gpu_, once it exists
  std::unique_ptr<gpu::Backend> gpu_;  // last: destroyed first, while the transport still works
};

}  // namespace kolo
