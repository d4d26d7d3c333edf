// What every ring algorithm needs: the transport, this rank's place in the ring, reusable buffers
// and the bounded wait. Nothing here knows about sockets.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/deadline.hpp"
#include "core/op_descriptor.hpp"
#include "core/page_buffer.hpp"
#include "core/reduce.hpp"
#include "ring/algorithms.hpp"
#include "ring/blocks.hpp"
#include "transport/transport.hpp"

namespace kolo {

// What a reducing schedule does with a received segment of partials: combine it with this rank's
// own elements into a partial (accumulator type), or finish the reduction into the output
// (element type). Attached to the receive as its sink, so that where the transport holds the
// payload in shared memory it is reduced from there, piece by piece, without first being copied
// into the receive slot; elsewhere complete() reduces it from the slot. The object must stay where
// it is until the receive completes.
struct IncomingReduction {
  const ReduceSpec* spec = nullptr;
  bool finish = false;
  std::byte* result = nullptr;     // the partial or the output, at the segment's first element
  const std::byte* own = nullptr;  // this rank's elements, at the segment's first element

  void attach(Transfer& transfer);
  // After the receive completed: the reduction the transport did not do already.
  void complete(const Transfer& transfer) const {
    if (!transfer.sunk) apply(0, transfer.data, transfer.bytes);
  }
  // Reduces `bytes` of incoming partials found `offset` bytes into the segment.
  void apply(size_t offset, const void* incoming, size_t bytes) const;
};

class SubsetTransport;

// Which host each rank of a ring is on, as the hierarchical allreduce needs it: hosts numbered
// 0, 1, ... in the order of their lowest rank, which is the host's leader.
class HostMap {
 public:
  HostMap() = default;
  // host_of[rank] for every rank: any numbers, equal for ranks of one host.
  explicit HostMap(const std::vector<int>& host_of);

  int host_of(int rank) const { return host_of_[rank]; }
  int leader_of(int rank) const { return leaders_[host_of_[rank]]; }
  // The host leaders, in host order.
  const std::vector<int>& leaders() const { return leaders_; }
  // The ranks on `host`, in rank order; a rank's place among them is its local index.
  const std::vector<int>& ranks_on(int host) const { return ranks_on_[host]; }
  int local_index(int rank) const { return local_index_[rank]; }
  // The rank at `local_index` on every host that has one, in host order.
  std::vector<int> at_local_index(int local_index) const;
  const HostShape& shape() const { return shape_; }

 private:
  std::vector<int> host_of_;
  std::vector<int> leaders_;
  std::vector<std::vector<int>> ranks_on_;
  std::vector<int> local_index_;
  HostShape shape_;
};

class Ring {
 public:
  Ring(Transport& transport, int rank, int size, size_t segment_bytes, double timeout_s);
  ~Ring();

  Transport& transport() { return transport_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int left() const { return (rank_ + size_ - 1) % size_; }
  int right() const { return (rank_ + 1) % size_; }
  size_t segment_bytes() const { return segment_bytes_; }
  // Changes the segment from the next collective on (and the leaders' ring's). Every rank must
  // make the same change between the same two collectives: a segment is a message, and the ranks'
  // messages must pair up (the fusion engine's autotuner carries it in a response).
  void set_segment_bytes(size_t bytes) {
    segment_bytes_ = bytes;
    for (Subring* subring : {&leaders_, &local_, &cross_}) {
      if (subring->ring) subring->ring->set_segment_bytes(bytes);
    }
  }
  // The pipeline segment for a schedule that moves `chunk_bytes` per step (a ring's chunk, a
  // chain's whole buffer): KOLO_SEGMENT_BYTES, or less where that would leave fewer than
  // kPipelineDepth segments, but not below kMinSegmentBytes (nor above KOLO_SEGMENT_BYTES). A
  // 4 MiB allreduce at N = 2 thus runs 256 KiB segments, eight a chunk, instead of two of 1 MiB,
  // so that both directions stay busy (measured: docs/tuning.md, "Ring segments").
  size_t segment_for(uint64_t chunk_bytes) const {
    const uint64_t floor = std::min<uint64_t>(kMinSegmentBytes, segment_bytes_);
    return std::clamp<uint64_t>(chunk_bytes / kPipelineDepth, floor, segment_bytes_);
  }
  static constexpr uint64_t kPipelineDepth = 8;
  static constexpr uint64_t kMinSegmentBytes = 256 << 10;

  // Buffers that grow to the largest size asked for and are then reused, so a training loop
  // allocates (and first-touches) them once. `which` names independent buffers.
  enum Buffer { kReceiveSlots = 0, kPartials = 1, kScratch = 2, kBufferCount = 3 };
  std::byte* buffer(Buffer which, size_t bytes);

  // `count` transfers, reset; the storage is reused across calls and does not move while posted.
  Transfer* transfers(size_t count);

  // Starts the no-progress clock for a new collective.
  void begin() {
    waiting_for_->store(-1, std::memory_order_relaxed);
    made_progress();
  }
  // Something completed: the no-progress clock starts again, read at the next wait() (a small
  // collective completes several transfers without waiting, and a read costs as much as a poll).
  void made_progress() { restart_clock_ = true; }
  // Waits for the transport; throws kolo::Error(kTimeout) naming the operation and the peer we
  // wait for when nothing has completed for the timeout, after telling every peer.
  void wait(const OpDescriptor& op, int waiting_for);
  // The peer the last wait() of the running collective named, -1 before any; any thread may ask
  // (the report of who is stuck, comm/report.hpp). A subset's ring writes its waits into the whole
  // ring's, by the whole ring's rank numbers.
  int waiting_for() const { return waiting_for_->load(std::memory_order_relaxed); }

  // What the allreduce dispatcher chooses from besides size and N: KOLO_ALLREDUCE and the hosts
  // (by default one host holding every rank). Set by the communicator once connected.
  void set_allreduce_placement(AllreduceMode mode, HostMap hosts);
  AllreduceMode allreduce_mode() const { return allreduce_mode_; }
  const HostMap& hosts() const { return hosts_; }
  // Rings over a subset of the ranks, over the same transport, made on first use; their
  // schedules are the ones of this file, unchanged. On a host leader: the leaders only (position =
  // host number). On every rank: the ranks of its own host (position = local index), and the
  // ranks with its local index on every host (position = host number).
  Ring& leaders();
  Ring& local();
  Ring& cross();

 private:
  // A ring over a subset of another's ranks: `ranks` gives each position's rank there, so that
  // errors name the ranks users know.
  Ring(Transport& transport, int rank, int size, size_t segment_bytes, double timeout_s,
       std::vector<int> ranks);
  int rank_name(int position) const { return ranks_.empty() ? position : ranks_[position]; }

  Transport& transport_;
  int rank_;
  int size_;
  size_t segment_bytes_;
  double timeout_s_;
  Deadline deadline_;
  bool restart_clock_ = true;  // deadline_ starts again at the next wait()
  PageBuffer buffers_[kBufferCount];
  std::vector<Transfer> transfers_;
  std::atomic<int> own_waiting_for_{-1};
  std::atomic<int>* waiting_for_ = &own_waiting_for_;
  std::vector<int> ranks_;  // empty: positions are ranks
  AllreduceMode allreduce_mode_ = AllreduceMode::kAuto;
  HostMap hosts_;
  struct Subring {
    std::unique_ptr<SubsetTransport> transport;
    std::unique_ptr<Ring> ring;  // after transport: destroyed first
    ~Subring();
    void reset();
  };
  Ring& subring(Subring& subring, const std::vector<int>& ranks, int position);
  Subring leaders_;
  Subring local_;
  Subring cross_;
};

// A ring with the transport it runs over, as connecting a group of ranks makes them
// (comm/connect.hpp). The ring is declared last so that it is destroyed first.
struct Links {
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Ring> ring;
};

// The one allreduce dispatcher: chooses the schedule for the buffer's size, N, KOLO_ALLREDUCE and
// the hosts (allreduce_algorithm() in ring/algorithms.hpp), writes it into the descriptor every
// message carries, and runs it. Every ordered allreduce goes through here; the fusion engine calls
// ring_allreduce() itself, as its fused layout follows the ring's chunks.
void run_allreduce(Ring& ring, OpDescriptor op, const void* sendbuf, void* recvbuf);

// The collectives, each in its own file with its schedule described at the top.
void ring_allreduce(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf);
// One buffer of an allreduce over several at once.
struct AllreducePiece {
  const void* send;
  void* recv;
  uint64_t count;
};
// The ring allreduce of several buffers in one schedule (op.count: their total): every element is
// reduced in the same chunk, in the same order, as ring_allreduce reduces its buffer alone, so the
// results are bitwise the same, but the pieces share the ring's 2(N-1) steps and its pipeline
// instead of paying them each. Nothing is copied.
void ring_allreduce_pieces(Ring& ring, const OpDescriptor& op,
                           const std::vector<AllreducePiece>& pieces);
void ring_broadcast(Ring& ring, const OpDescriptor& op, void* buffer);
void ring_barrier(Ring& ring, const OpDescriptor& op);
// Returns once every rank has entered a call with the same descriptor; KOLO_ERR_MISMATCH on every
// rank otherwise. Collectives whose data flow does not already tie every rank together use it.
void ring_agree(Ring& ring, const OpDescriptor& op);

// Every rank's block of `blocks` (this rank's from sendbuf) into recvbuf, on every rank.
void ring_allgather(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                    const Blocks& blocks);
void bruck_allgather(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                     const Blocks& blocks);
// Whichever of the two op.algorithm names (allgather_algorithm() in ring/algorithms.hpp).
void allgather_blocks(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                      const Blocks& blocks);
// sendbuf holds blocks.total elements; this rank's block of the reduction goes to recvbuf.
void ring_reduce_scatter(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                         const Blocks& blocks);
// Allreduce for small buffers: op.algorithm == Algorithm::kRecursiveDoubling (see run_allreduce()).
void recursive_doubling_allreduce(Ring& ring, const OpDescriptor& op, const void* sendbuf,
                                  void* recvbuf);
// Allreduce across hosts (see run_allreduce() and ring/allreduce_hierarchical.cpp), over
// ring.hosts(): through the host leaders (op.algorithm == Algorithm::kHierarchical), or by shards
// (Algorithm::kHierarchicalShards, hosts with equally many ranks only).
void hierarchical_allreduce(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf);
void sharded_hierarchical_allreduce(Ring& ring, const OpDescriptor& op, const void* sendbuf,
                                    void* recvbuf);
// Fills `count` elements with the identity of op in dtype's bits: x OP identity == x for every x,
// NaN included (-0 for sums, 1 for products, +inf/-inf or the integer limits for min/max).
void fill_identity(std::byte* buffer, uint64_t count, DataType dtype, ReduceOp op);
// Per-peer blocks between every pair of ranks. op.detail != 0 (alltoallv): messages carry their
// pair's count and an agreement round ends the call.
void pairwise_alltoall(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf,
                       const AlltoallLayout& layout);
// The reduction of every rank's sendbuf into recvbuf on op.root (recvbuf unused elsewhere).
void chain_reduce(Ring& ring, const OpDescriptor& op, const void* sendbuf, void* recvbuf);
// Point to point: op describes the message (collective kSendRecv, root = the sender).
void send_to_peer(Ring& ring, const OpDescriptor& op, const void* buffer, int peer);
void receive_from_peer(Ring& ring, const OpDescriptor& op, void* buffer, int peer);

}  // namespace kolo
