// The transport interface: moving bytes between ranks.
//
// A handful of non-blocking verbs, in the spirit of NCCL's network plugins: post a send or a
// receive of a buffer to a peer, and make progress until transfers complete. Messages between a
// pair of ranks are matched in order: the k-th receive posted for a peer takes the k-th message
// that peer sent.
//
// What a transport knows of collectives, and no more: every message carries the OpDescriptor of
// the call it belongs to, which the transport compares for equality only (transport/framing.hpp:
// the receiver checks it against its own, so ranks that disagree get KOLO_ERR_MISMATCH instead of
// corrupt data or a hang), and a receive may carry a sink, the one optional verb: a callback that
// consumes the payload where the transport holds it (see Transfer::sink). Schedules, reductions
// and the order of ranks are the ring layer's (src/ring/).
//
// Failures are exceptions (kolo::Error) thrown from progress(): a lost peer (kPeerLost, naming the
// rank), a disagreement (kMismatch, naming both sides), or an abort announced by another rank,
// which carries that rank's status and message. After a failure the transport is broken: posted
// transfers are forgotten, and every later call throws the same error.
//
// Adding a transport: a folder under src/transport/ and one line in the registry
// (transport/registry.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/deadline.hpp"
#include "core/op_descriptor.hpp"
#include "kolo/status.hpp"

namespace kolo {

class StoreClient;
struct PreparedMesh;

// What a transport is told to connect with, and nothing else of the job's configuration (no
// fusion, GPU or ring settings). Every field is read and validated with the other settings in
// core/config.cpp before anything connects, so that a bad value fails kolo_comm_init at once with
// one message and docs/environment.md's table of variables is one list; the communicator layer
// fills this from it (comm/connect.cpp).
struct TransportSettings {
  std::string transport = "auto";     // KOLO_TRANSPORT: a registry name or "auto"
  std::string addr;                   // KOLO_ADDR: the store, and the route toward other hosts
  std::string secret;                 // the job secret every connection proves
  double timeout_s = 300.0;           // KOLO_TIMEOUT: every wait during set-up
  std::string socket_ifname;          // KOLO_SOCKET_IFNAME: where to listen ("" = by route)
  // Where to listen, when the caller has already agreed on it with the group
  // (mesh_listen_host); "" = the transport finds it itself, one more exchange through the store.
  std::string listen_host;
  // Where the group already exchanged what a transport publishes (transport/mesh.hpp): the first
  // mesh connected with these settings takes its listener and peers' addresses from here instead
  // of the store, and KOLO_TRANSPORT=auto decides from its facts. Null: through the store.
  std::shared_ptr<PreparedMesh> prepared;
  std::string host;                   // this rank's host identity (core/host.hpp)
  int local_size = -1;                // ranks on this host, -1 when unknown
  // How a wait spins before it sleeps (transport/shm/waiting.hpp). own_core: kolo bound this rank
  // to a core that no other rank of this host is bound to (KOLO_BIND=core, no more ranks than
  // cores). yield_at_once: the waiting thread is the fusion engine's, which shares the CPUs with
  // the application's threads.
  bool own_core = false;
  bool yield_at_once = false;
  int tcp_streams = 1;                // tcp: KOLO_TCP_STREAMS data connections per peer
  std::string tcp_congestion = "auto";  // tcp: KOLO_TCP_CONGESTION (net::set_congestion_control)
  // KOLO_SHM: kolo's shared-memory rings (transport/shm/) for the peers on this host, "1" or "0";
  // make_transport turns "auto" into one of them for the transport it connects.
  std::string shm = "auto";
  std::string shm_copy = "auto";  // KOLO_SHM_COPY: auto, plain or stream
};

// One send or receive. The caller owns it and keeps it (and its buffer) alive and unmoved until
// `complete` is set or the transport fails. The transport links posted transfers through `next`,
// so posting never allocates.
struct Transfer {
  int peer = -1;
  OpDescriptor descriptor;
  void* data = nullptr;
  size_t bytes = 0;

  // The sink, an optional verb of receives: "consume the payload where you hold it". A
  // transport whose payload lies in memory this process can read (kolo's shared-memory rings)
  // calls sink(sink_context, offset, piece, length) for consecutive pieces of the message, in
  // order, each starting at a multiple of sink_grain bytes (the last may be shorter), instead of
  // copying them into `data`, and sets `sunk`; `data` is then left unwritten. Any other transport
  // ignores the sink, fills `data` and leaves `sunk` false, and the caller consumes `data` itself
  // once the receive is complete (ring/ring.hpp, IncomingReduction::complete). A reducing
  // collective thus reduces straight out of shared memory, one copy fewer, and is correct on
  // every transport. The sink runs inside progress(), on the caller's thread, and must not call
  // the transport.
  using Sink = void (*)(void* context, size_t offset, const void* piece, size_t length);
  Sink sink = nullptr;
  void* sink_context = nullptr;
  size_t sink_grain = 1;

  // Transport state.
  bool complete = false;
  bool sunk = false;
  size_t done = 0;
  Transfer* next = nullptr;

  void reset(int to_peer, const OpDescriptor& op, void* buffer, size_t length) {
    peer = to_peer;
    descriptor = op;
    data = buffer;
    bytes = length;
    sink = nullptr;
    sink_context = nullptr;
    sink_grain = 1;
    complete = false;
    sunk = false;
    done = 0;
    next = nullptr;
  }
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual const char* name() const = 0;

  // Queue transfer for sending to transfer.peer; it may complete at once.
  virtual void post_send(Transfer& transfer) = 0;
  // Queue transfer to receive the next message from transfer.peer.
  virtual void post_recv(Transfer& transfer) = 0;
  // Waits for network activity (no longer than the deadline) and advances every posted transfer.
  // Returns after at least one event or at the deadline; the caller checks its transfers.
  virtual void progress(const Deadline& deadline) = 0;

  // Marks the transport broken with this error (a transport that failed already keeps its first
  // one), forgets posted transfers and tells every peer unless it did already (best effort, never
  // blocks for long), so that no rank waits for this one any more. A transport that failed on its
  // own tells the peers too, except for a PeerLeft (control_channel.hpp).
  virtual void abort(const Error& error) noexcept = 0;
  // The error that broke the transport, if any (then every call rethrows it).
  virtual const Error* failure() const = 0;

  // A file descriptor that poll() reports readable when progress() has something to do (a
  // message or a failure arrived), so that an idle caller can sleep in poll() beside its own
  // descriptors and call progress() when woken; -1 when the transport has none, and the caller
  // must then call progress() every few milliseconds instead.
  virtual int readiness_fd() const { return -1; }

  // Whether messages to and from `peer` are copies through memory this host shares (kolo's
  // shared-memory rings) rather than the network. Where they are, a collective's fixed cost is a
  // few microseconds and memory traffic is what counts (the fusion engine runs large tensors one
  // by one there, coordinator.hpp).
  virtual bool through_memory(int /*peer*/) const { return false; }
  // Whether through_memory() holds for every pair of ranks, the same answer on every rank (which
  // through_memory() alone does not promise when one pair's segment failed), so that a schedule
  // may follow from it (recursive doubling's one-shot form, ring/allreduce_recursive_doubling.cpp).
  virtual bool through_memory_everywhere() const { return false; }
};

// One transport as the registry (transport/registry.cpp) lists it.
struct TransportEntry {
  // Connects this rank to every peer, exchanging addresses through the store; throws
  // kolo::Error on failure.
  using Connect = std::unique_ptr<Transport> (*)(const TransportSettings& settings,
                                                 StoreClient& store, int rank, int size,
                                                 uint64_t context);
  // KOLO_TRANSPORT=auto: whether this transport should carry this job. Collective: every rank
  // calls it with the same arguments and gets the same answer (rank 0 decides through the
  // store). `reason` says why, for the log.
  using Probe = bool (*)(const TransportSettings& settings, StoreClient& store, int rank, int size,
                         uint64_t context, std::string& reason);

  const char* name;            // as KOLO_TRANSPORT spells it
  Connect connect;             // null where this build lacks the transport
  Probe probe;                 // null: auto never picks it, but for the fallback
  const char* missing_reason;  // where connect is null: why, and how to get it
};

// Every transport kolo knows, in the order KOLO_TRANSPORT=auto probes them; the last one built is
// auto's fallback.
const std::vector<TransportEntry>& transport_registry();

// What this rank tells the others so that KOLO_TRANSPORT=auto decides without the store, for a
// group that exchanges it with its other start-up records (PreparedMesh::auto_facts); "" where
// no transport of this build probes.
std::string transport_auto_facts(const TransportSettings& settings);

// Connects this rank to every peer with the transport settings.transport names (or, for auto, the
// first of the registry whose probe says yes, else the fallback). `context` tells the connections
// of different communicators apart. Throws kolo::Error on failure.
std::unique_ptr<Transport> make_transport(const TransportSettings& settings, StoreClient& store,
                                          int rank, int size, uint64_t context);

}  // namespace kolo
