// Rank 0's half of the negotiation: from every rank's RequestList of a cycle, decide what is
// ready, check that the ranks agree, choose cache slots and plan the fused batches.
//
// A unit is ready when every rank has submitted it. Rank 0 learns of a submission in one of two
// ways: an announcement carrying the spec (units not in the cache), or a bit in the rank's
// ready vector (units in cache slot s, spec known to all). Units whose bit is set on every rank
// are cache hits and cost no bookkeeping at all. Everything else goes into the ledger, one entry
// per key, which remembers which rank submitted which spec and when, until either every rank has
// submitted (then the unit is ready if all specs are equal, or fails with KOLO_ERR_MISMATCH on
// every rank), or it is aborted as stalled (KOLO_STALL_ABORT_S). Rank 0 warns about entries older
// than KOLO_STALL_WARNING_S, naming the ranks that have not submitted them.
//
// Allgathers. Each rank submits its own count and receive capacity, so the ledger compares their
// agreed parts (kind, dtype, name; see spec.hpp) and keeps the counts and capacities per rank.
// Once every rank agrees, the scheduled spec carries every rank's count; if the gathered total
// exceeds any rank's capacity (or cannot be addressed at all), the tensor fails on every rank
// with KOLO_ERR_INVALID_ARGUMENT naming the capacity, the rank and the total, and nothing is sent.
// Allgathers are never given a cache slot: their counts may change every step (sparse gradients),
// and a cached spec with last step's counts could only be reused after checking every rank's new
// count, which is the full negotiation again. They always run alone, one collective each.
//
// Join. A rank that has called kolo_join says so in every RequestList until every rank has
// joined. Until then it counts as having submitted every unit that the others submit (so a unit
// is ready once every rank that has not joined has submitted it) and takes part with zeros:
// nothing for an allgather (count 0), zeros for an allreduce; a broadcast whose root has joined
// without submitting it fails with KOLO_ERR_INVALID_ARGUMENT. The cycle in which the last rank
// joins answers with that rank (ResponseList::all_joined), and every rank leaves kolo_join.
//
// Cache slots. A unit negotiated through announcements is given a slot: its old slot if its key
// was cached with another spec, else a never-used slot, else the least recently used slot that no
// rank is waiting on in this cycle (whose bit nobody set: evicting it cannot strand a pending
// unit, since a rank looks its units up in the cache afresh every cycle). When every slot is
// busy the unit is simply not cached. Every rank applies the assignment when it reads the
// response, so the caches stay identical.
//
// Batches. Ready units are taken in order (the oldest first; those first seen in the same cycle
// in the order rank 0 learnt of them: announcements by rank, then cache hits by slot); each starts
// a batch, and later units that can be fused with it (allreduce, same dtype, op and factors) join
// while the padded size stays within the fusion threshold, looking past units that do not fit. A
// unit is padded to a multiple of N elements per member (see fused_layout.hpp), so the test is
// exact; units reduced by recursive doubling (engine_algorithm() in spec.hpp) are fused only with
// each other, and at most latency_batch_bytes() of them. Broadcasts run alone, and so does
// everything when the threshold is 0. A group is one unit and therefore always runs as one
// collective; one larger than the threshold runs alone in a buffer of its own size.
//
// A single tensor of alone_bytes() or more also runs alone, in place in the caller's buffer: at
// most kAloneBytes, less where rank 0 has measured that fusing a smaller tensor costs more than
// it saves (fusion_cost.hpp). Fusion saves a collective's latency (microseconds on one host, tens
// to hundreds of microseconds across hosts) at the price of copying the tensor in and out of the
// fusion buffer, and of a buffer too large to stay in cache: from about a megabyte the copies
// cost as much as the latency saved even across hosts, and for larger tensors they only add
// (bench/fusion_perf measured ResNet-50 1.4 to 1.7 times slower with its 1-9 MiB gradients fused
// than with nothing fused, on TCP loopback). Results do not depend on it: a tensor reduced alone
// and one reduced in a fused buffer are bitwise the same.
//
// Such tensors, when the ring reduces them, still share a collective: the first starts a batch on
// one ring (Batch::one_ring), and later ready ones of its kind (fusable(), alone too) join while
// their bytes stay within the fusion threshold. The executor runs the batch as one ring allreduce
// over the callers' buffers (ring_allreduce_pieces, ring/allreduce.cpp): no copy, each tensor
// bitwise as alone, and the ring's 2(N-1) steps and pipeline paid once instead of per tensor. With
// the threshold at 0 they run one collective each, as everything does.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/deadline.hpp"
#include "fusion/cache.hpp"
#include "fusion/wire.hpp"
#include "ring/algorithms.hpp"

namespace kolo::fusion {

// When rank 0 learnt of each rank's submission of a unit that became ready (for the timeline).
struct Arrival {
  std::string key;
  std::vector<Clock::time_point> per_rank;
};

// Single tensors at least this large are not fused (see above).
inline constexpr uint64_t kAloneBytes = uint64_t{1} << 20;

// The most a fused batch of units that run recursive doubling (engine_algorithm() in spec.hpp)
// holds: four times the most that kolo_allreduce runs so. Every message of that schedule holds
// the whole buffer, log2 N of them where the ring sends 2(N-1)/N of it, so a larger batch runs as
// several.
inline uint64_t latency_batch_bytes(int ranks) {
  return 4 * kRecursiveDoublingMaxBytesPerRank * static_cast<uint64_t>(ranks);
}

struct CoordinatorSettings {
  int ranks = 1;
  double stall_warning_s = 60.0;  // 0: never warn
  double stall_abort_s = 0.0;     // 0: never abort
  // Whether tensors too large to fuse share one ring (see above): rank 0 reaches its ring
  // neighbours over the network, not through shared memory.
  bool one_ring = true;
};

class Coordinator {
 public:
  Coordinator(const CoordinatorSettings& settings, const ResponseCache& cache);

  // lists[r] is rank r's RequestList for this cycle (rank 0's own included). Throws
  // kolo::Error(kInternal) when a rank sets a bit for an empty cache slot. When arrivals is not
  // null it receives one entry per ready unit.
  ResponseList process(uint64_t cycle, const std::vector<RequestList>& lists,
                       uint64_t fusion_threshold, Clock::time_point now,
                       std::vector<Arrival>* arrivals = nullptr);

  // Single tensors of this many bytes or more run alone from now on (fusion_cost.hpp); at most,
  // and at first, kAloneBytes.
  void set_alone_bytes(uint64_t bytes) { alone_bytes_ = std::min(bytes, kAloneBytes); }
  uint64_t alone_bytes() const { return alone_bytes_; }

  // Units submitted by some ranks and not yet ready.
  size_t outstanding() const { return ledger_.size(); }
  // The oldest names that some ranks have submitted and others not yet, each with its age and
  // the ranks missing ("'b' for 2.1 s, missing rank 0; ..."); "" when there are none.
  std::string waiting_summary(Clock::time_point now) const;

 private:
  struct Entry {
    std::vector<UnitSpec> specs;        // the distinct specs submitted
    std::vector<int32_t> spec_of_rank;  // index into specs, -1: not submitted yet
    std::vector<Clock::time_point> arrived;
    std::vector<uint64_t> gather_counts;  // allgathers: [rank], as submitted
    std::vector<uint64_t> capacities;     // allgathers: [rank], the recv_capacity submitted
    int submitted = 0;
    Clock::time_point first_seen;
    uint64_t order = 0;  // when the entry was created, to order entries seen in the same cycle
  };
  struct Ready {
    bool hit = false;
    int32_t slot = -1;
    const UnitSpec* spec = nullptr;  // points into the cache or into the ready specs
    Clock::time_point first_seen;
    uint64_t order = 0;
  };

  Entry& entry_for(const std::string& key, Clock::time_point now);
  void record(Entry& entry, int rank, const UnitSpec& spec, Clock::time_point now);
  std::string mismatch_message(const std::string& key, const Entry& entry) const;
  // "" when every rank's recv_capacity holds the gathered total, else the error message.
  std::string capacity_problem(const std::string& key, const Entry& entry) const;
  void check_stalls(Clock::time_point now, ResponseList& response);
  // The ranks that have (present) and have not (missing) submitted the entry.
  void split_ranks(const Entry& entry, std::vector<int>& present, std::vector<int>& missing) const;
  int32_t choose_slot(const UnitSpec& spec, uint64_t cycle, const std::vector<uint32_t>& busy);
  void touch(uint32_t slot, uint64_t cycle);
  std::vector<Batch> plan(const std::vector<Ready>& ready, uint64_t fusion_threshold) const;
  // Submitted by every rank that has not joined (and by one rank at least)?
  bool complete(const Entry& entry) const;
  // "" unless spec is a broadcast and a rank has joined without submitting it (submitted(r)
  // tells whether rank r did): its root would have no data to send, any other rank would miss
  // what is sent (Horovod refuses a broadcast while a rank has joined, for the same reason).
  template <typename Submitted>
  std::string joined_broadcast_problem(const UnitSpec& spec, Submitted submitted) const;
  uint64_t padded_bytes(const UnitSpec& spec) const;

  CoordinatorSettings settings_;
  const ResponseCache& cache_;
  uint64_t alone_bytes_ = kAloneBytes;
  std::unordered_map<std::string, Entry> ledger_;
  static constexpr uint32_t kNoSlot = ~uint32_t{0};
  // The slots ever used, least recently used first: a list threaded through two vectors, so that
  // a touch moves a slot to the end without allocating (it happens for every unit every cycle).
  std::vector<uint64_t> last_used_;  // [slot]: the cycle that last used it
  std::vector<uint32_t> newer_;      // [slot]: the next slot in the list, or kNoSlot
  std::vector<uint32_t> older_;      // [slot]: the previous slot in the list, or kNoSlot
  uint32_t oldest_ = kNoSlot;
  uint32_t newest_ = kNoSlot;
  uint32_t never_used_ = 0;  // slots [never_used_, capacity) have never been assigned
  uint64_t next_order_ = 0;
  Clock::time_point last_warning_{};
  std::vector<bool> joined_;  // [rank]: has called kolo_join, until every rank has
  int joined_count_ = 0;
  int last_joined_ = -1;
};

// "rank 2", "ranks 0, 1, 5", "ranks 0-63": for messages.
std::string format_ranks(const std::vector<int>& ranks);

}  // namespace kolo::fusion
