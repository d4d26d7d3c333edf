// kolo's own shared-memory data path between two ranks of one host, beside the network of the
// transport that runs it (UCX or TCP; KOLO_SHM).
//
// Why. Over TCP, every byte between two ranks of one host crosses the loopback: two copies
// through the kernel and a system call per piece. Within a host UCX moves large messages with one
// CMA copy (process_vm_readv), which pins pages and walks page tables on every call. Two plain
// memcpy()s through a ring of shared slots that stays mapped for the life of the communicator move
// more bytes a second (bench/intra_host_copy measures both; docs/architecture.md, "The UCX
// transport", describes the rings), and a ring allreduce at N = 2 spends most of its time in these
// copies.
//
// The segment. Each pair of ranks on one host shares one segment, created by the lower rank
// (shm_open with a random name, mode 0600, O_EXCL, the memory reserved with posix_fallocate so
// that a full /dev/shm fails at set-up instead of with SIGBUS later). Its name and a random
// cookie travel over the pair's control socket, which has already proved the job secret; the
// higher rank opens it, checks the cookie, and both unlink the name at once, so nothing is left
// in /dev/shm and nothing else can open it. The segment holds two single-producer single-consumer
// rings, one per direction, each of kSlots slots of kSlotBytes (8 × 256 KiB): a header page
// with the two rings' counters, each on its own cache line, then the two data areas.
//
// Why so small. A ring that holds 2 MiB stays in the last-level cache beside the caller's
// buffers, so a piece is usually read out of the cache it was just written into; larger rings
// push the caller's buffers out of it and measured slower (docs/architecture.md, "The UCX
// transport", has the figures). A segment is 4 MiB of /dev/shm per pair.
//
// Messages. A ring is a byte stream: the producer owns `head`, the consumer owns `tail`, both
// counting bytes since the start. Every message begins on a cache line whose first word, stored
// last and atomically (release), says that it is there: its kind, its length where it is small,
// and a stamp, the line's number in the stream, so that the word a line kept from an earlier lap
// never passes for a new one (shm_segment.hpp has the layout). The consumer waits on that word at
// its own position, never on a counter in another line.
//  - A small message (at most shm::kSmallBytes = 40 bytes of payload, and a descriptor without
//    scale factors or detail, with count and sequence within 32 bits: shm::fits_small) is that one
//    line: the word, a compact descriptor and the payload. One line moves between the cores.
//  - Any other message is a frame (transport/framing.hpp: the header, then the payload): its first
//    line is the word and the header's length and descriptor (the word stands for the magic), and
//    the payload follows on the next lines, padded to 64 bytes. The first piece of payload is
//    written before the header's word, which says how long it is, so a message sent in one piece
//    is published by its word alone; each later piece is published by a store of `head` (stored
//    with the first piece too when more are to come, before the word, so that a consumer that
//    saw the word finds `head` past what the word announced). A copy is at most a slot long and
//    never crosses the end of the ring, and each is published at once, so the consumer copies
//    one slot's worth out while the producer fills the next.
//    (Cutting at the slots' own boundaries instead would split every slot-sized message into a
//    big piece and a 64-byte one.)
// Payload bytes may look like any word, so the producer clears the word of a line that held
// payload a lap ago before it publishes the message that ends where that line begins (a bitmap
// of such lines, Link::clear_line): the consumer, who reads that word next, sees zero or the next
// message's, nothing else. It keeps two lines free for this (padding and the cleared line). The
// consumer publishes `tail` after every message, a line only the producer reads, and the producer
// reads it only when the value it loaded last leaves too little room, since each load fetches the
// counter's line from the consumer's core. Small or large, messages interleave freely: each is
// read at the position where the one before it ended. The producer copies with plain stores, or
// with non-temporal ones while the consumer's core shares no cache with its own (copy_into_ring
// in shm_channel.cpp, KOLO_SHM_COPY); a receive that carries a sink (Transfer::sink) gets the
// payload handed to it where it lies instead of copied out, in pieces of whole elements (grains
// that divide 64 bytes, so that the end of the ring falls between two).
// The k-th receive posted for a peer takes the k-th message in its ring: ALL messages to a peer
// that has a ring go through it (the network carries none of them), so the order of messages
// cannot be broken between two paths. The receiver copies the header (or the small line) out of
// the ring and checks it before a byte of payload moves: another descriptor or another length is
// KOLO_ERR_MISMATCH with the same words as the network path, and nothing is ever written past the
// posted buffer. Counters or words that make no sense (a reader ahead of the writer, more than the
// ring holds in flight, a line stamped for another place) are a lost peer, never a wild copy.
//
// Waking. No thread of its own: pump() copies what the rings allow, in both directions, for every
// peer, and the transport calls it from progress() (waiting.hpp: the spin, the readiness flag).
// Before a rank sleeps in poll() it sets a flag in the ring it waits on ("consumer waiting" when it
// has receives posted, "producer waiting" when it has sends queued) and then looks at the rings
// once more; a peer that publishes (a line's word, `head` or `tail`) and finds the flag set clears
// it and rings a doorbell: a WAKE frame on the pair's control socket, which is in the sleeper's
// poll set already. The flag, the words and the counters are stored and loaded sequentially
// consistent on both sides (Dekker), so either the sleeper sees what was published or the peer
// sees the flag: no wake-up is lost, and one flag yields one doorbell at most.
//
// Faults. A dead peer's counters simply stop; nothing here waits on them (pump() returns when
// nothing can move), the sleeper wakes on the control channel, which reports the lost rank. The
// segment stays mapped until this rank's transport is destroyed, so a peer still writing into a
// ring after this rank failed writes into live memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/deadline.hpp"
#include "transport/mesh.hpp"
#include "transport/transport.hpp"

namespace kolo {

class ControlChannel;
struct FrameHeader;
namespace shm {
enum class Arrival;
}

class ShmChannel {
 public:
  static constexpr size_t kSlotBytes = size_t{256} << 10;
  static constexpr size_t kSlots = 8;

  // How pieces are copied into a ring (KOLO_SHM_COPY): plain stores, non-temporal stores, or
  // whichever suits where the consumer's core is (see copy_into_ring in shm_channel.cpp).
  enum class Copy { kAuto, kPlain, kStream };
  static Copy copy_mode(const std::string& name) {
    return name == "plain" ? Copy::kPlain : name == "stream" ? Copy::kStream : Copy::kAuto;
  }

  // `transport` names the transport that runs the rings beside its network ("ucx", "tcp"), for
  // the log.
  ShmChannel(int rank, int size, ControlChannel& control, const char* transport);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // Set-up, over each pair's authenticated control socket before it is attached to the control
  // channel: which peers share this host (`host`, this rank's host identity, core/host.hpp), and
  // for those a segment. Where `enabled` is false on either side, the peer is on another host or
  // the segment cannot be made, the pair keeps the network. Logs the path of every peer at INFO.
  // Throws only when a socket fails.
  void connect(const std::vector<PeerSockets>& sockets, const std::string& host, bool enabled,
               Copy copy, const Deadline& deadline);

  // Makes a mapped segment of segment_bytes() (shm_segment.hpp) the link to `peer`, this rank on
  // the side its rank gives it; the channel unmaps it when destroyed. connect() adopts every
  // segment it makes or opens; tests/fuzz/shm_ring.cpp adopts one that it writes as a hostile
  // peer would.
  void adopt_segment(int peer, void* mapping);
  static size_t segment_bytes();

  bool connected(int peer) const { return links_[peer] != nullptr; }
  bool any() const { return connected_count_ > 0; }
  // Whether a ring links every pair of ranks of the communicator, as every rank found it after
  // connect() (each tells the others whether it reached all of its peers so): the same answer on
  // every rank even where a single pair's segment could not be made.
  bool everywhere() const { return everywhere_; }
  // Whether some peer is on another host (host identities differ), known after connect().
  bool any_other_host() const { return other_hosts_ > 0; }
  // Transfers posted to `peer` and not complete yet.
  size_t pending(int peer) const;

  // Queue a transfer to or from a connected peer, and move what can move at once. True when that
  // moved data while prepared to sleep: the caller is awake again and must say so (its
  // readiness fd), since no doorbell will come for what already moved.
  bool post_send(Transfer& transfer);
  bool post_recv(Transfer& transfer);

  // Copies what the rings allow, for every peer and both directions, until nothing more can move
  // or a transfer completed. Sets `moved` when a byte moved; returns true when a transfer
  // completed. Throws kolo::Error for a mismatch or a peer that corrupts its ring.
  bool pump(bool& moved);

  // Before sleeping: asks the peers this rank waits on to ring the doorbell when they move, and
  // keeps asking for transfers posted later, until end_sleep(). The caller must call pump()
  // afterwards and sleep only if nothing moved.
  void prepare_sleep();
  // Awake again: no doorbells wanted.
  void end_sleep();

  // Checks the next message of every ring that has no receive posted against the collective this
  // rank is in (check_unexpected_frame, transport/framing.hpp); throws kolo::Error(kMismatch).
  void check_unexpected(const OpDescriptor& current) const;

  // After a failure: forget every posted transfer; nothing is copied any more.
  void forget();

 private:
  struct Link;

  bool send_piece(int peer, Link& link, bool& completed);
  bool receive_piece(int peer, Link& link, bool& completed);
  void consumed(int peer, Link& link, uint64_t tail);
  shm::Arrival arrival(const Link& link, FrameHeader& header, const char*& payload,
                       uint64_t& announced);

  int rank_;
  int size_;
  const char* transport_;
  std::string network_;  // the transport's name in capitals: what a peer without a ring keeps
  ControlChannel& control_;
  std::vector<std::unique_ptr<Link>> links_;
  int connected_count_ = 0;
  bool everywhere_ = false;
  int other_hosts_ = 0;
  bool sleeping_ = false;
  Copy copy_ = Copy::kAuto;
};

}  // namespace kolo
