// The negotiation messages of the fusion engine and their encoding.
//
// Every cycle each rank other than 0 sends rank 0 a RequestList, and rank 0 answers every rank
// with the same ResponseList; after an idle response rank 0 starts the next cycle with a WAKE, and
// a rank that leaves while everyone is idle says BYE instead, where its peers expect a message.
// Each message is a fixed MessageHeader followed, when payload_bytes > 0, by a payload message
// of exactly that many bytes (the transport matches messages between two ranks in order, so the
// receiver posts the payload once it has read the header). Payloads are fields in the host's byte
// order (every rank of a job runs the same build on the same kind of machine), written and read
// one by one; every length and count read is bounded before anything is allocated, and a
// malformed payload is an error naming the sender, never a crash.
//
// A spec is kind, dtype, op (u8 each), root (i32), prescale, postscale (f64), the member count
// (u32) and per member its name (u32 length, bytes) and count (u64); an allgather adds its
// recv_capacity (u64) and its gathered counts (u32 n, then n u64): none in an announcement, one
// per rank in a response. Allgathers are never cached nor fused, so a response that says
// otherwise is malformed. A batch is its kind (u8: 0 apart, 1 fused, 2 on one ring), its unit
// count (u32) and its units.
//
// A response may end with the engine's settings (only the autotuner sends them, only in the
// cycle after it changed them): a tag byte (1), the fusion threshold (u64), the cycle time in
// milliseconds (f64), the ring segment (u64) and whether they are final (u8). A response without
// it is the same bytes as before the settings existed, and a decoder meets anything after the
// batches only as this section: another tag, a value outside what KOLO_FUSION_THRESHOLD,
// KOLO_CYCLE_TIME_MS and KOLO_SEGMENT_BYTES accept, or bytes after it are malformed.
//
// A decoded response is checked whole before any of it is acted on: every cache hit names a slot
// that this rank's cache holds, no slot appears twice, and the units of a fused batch are
// allreduces that fusable() accepts together (the executor copies every member of a fused batch
// with the first unit's element size, so a float64 member beside a float32 one, or a broadcast,
// would be copied past its buffer); those of a batch on one ring are too, and run the ring.
// Decoders allocate as elements arrive, never by a count read from the wire: a count is only
// bounded by the bytes left, and those bytes cost far more in memory than on the wire (a 5-byte
// cache hit is an 88-byte ResponseUnit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fusion/cache.hpp"
#include "fusion/spec.hpp"
#include "kolo/status.hpp"

namespace kolo::fusion {

inline constexpr uint32_t kMessageMagic = 0x4b465553;  // "SUFK" on the wire
inline constexpr uint64_t kMaxPayloadBytes = uint64_t{64} << 20;
inline constexpr size_t kMaxErrorText = 16384;

enum class MessageKind : uint8_t {
  kRequests = 1,   // rank r -> rank 0, every cycle
  kResponses = 2,  // rank 0 -> every rank, every cycle
  kWake = 3,       // rank 0 -> every rank, before the first cycle after an idle one
  kBye = 4,        // in place of a WAKE or of a RequestList: the sender's communicator was
                   // destroyed while every rank was idle (a normal departure, not a failure)
};

struct MessageHeader {
  uint32_t magic = kMessageMagic;
  uint8_t kind = 0;
  uint8_t reserved[3] = {};
  uint32_t cache_capacity = 0;  // the sender's KOLO_CACHE_CAPACITY, which must agree
  uint32_t reserved2 = 0;
  uint64_t cycle = 0;
  uint64_t payload_bytes = 0;
};
static_assert(sizeof(MessageHeader) == 32, "MessageHeader is sent as it is laid out in memory");

// What one rank tells rank 0 in a cycle.
struct RequestList {
  // Bit s (word s / 64, bit s % 64) is set while this rank has a pending unit that the response
  // cache holds in slot s. Only the words up to the highest set bit are sent.
  std::vector<uint64_t> ready_words;
  // Pending units that are not in the cache (or whose spec differs from the cached one), each
  // announced once.
  std::vector<UnitSpec> announcements;
  // This rank has called kolo_join and waits for the others: it takes part with zeros in what
  // they submit (engine.cpp, "Join"). Sent every cycle until every rank has joined.
  bool joined = false;
};

// One unit of a response: a cache hit names a slot; anything else carries the whole spec and the
// slot that every rank stores it in from now on (-1: not cached).
struct ResponseUnit {
  bool hit = false;
  int32_t slot = -1;
  UnitSpec spec;  // when !hit
};

// The spec a response unit stands for: its own, or for a hit the one in `cache` (nullptr when
// that slot is empty).
inline const UnitSpec* spec_of(const ResponseUnit& unit, const ResponseCache& cache) {
  return unit.hit ? cache.at(static_cast<uint32_t>(unit.slot)) : &unit.spec;
}

// Units run as one collective through the fusion buffer (fused), as one ring allreduce over
// their own buffers (one_ring: single tensors too large to fuse), or one after the other (neither:
// a single unit, a broadcast, an allgather, or a group when fusion is off).
struct Batch {
  bool fused = false;
  std::vector<ResponseUnit> units;
  bool one_ring = false;
};

// A unit that fails on every rank that submitted it (ranks disagree, or it stalled too long).
struct ResponseError {
  std::string key;
  Status status = Status::kInternal;
  std::string message;
};

// The settings that every rank applies together, before the batches of the response carrying them
// (fusion/autotune.hpp decides them on rank 0).
struct EngineSettings {
  uint64_t fusion_threshold = 0;  // bytes; rank 0 plans with it, the others size their buffers
  double cycle_time_ms = 0;
  uint64_t segment_bytes = 0;  // the ring's pipeline segment: must agree for every collective
  bool final = false;          // the autotuner has settled: these stay
  bool operator==(const EngineSettings&) const = default;
};

// What rank 0 tells every rank in a cycle, executed in this order: settings, errors, then the
// batches.
struct ResponseList {
  bool idle = false;        // nothing is pending on any rank after this response: sleep until woken
  int32_t all_joined = -1;  // >= 0: every rank has joined; the rank that joined last
  std::vector<ResponseError> errors;
  std::vector<Batch> batches;
  std::optional<EngineSettings> settings;
};

void encode(const RequestList& list, std::vector<uint8_t>& out);
void encode(const ResponseList& list, std::vector<uint8_t>& out);
size_t encoded_size(const UnitSpec& spec);

// Decoders throw kolo::Error(kInternal) naming what is malformed. Specs are checked with
// check_spec() for `ranks`; slots and bit words must fit in `cache_capacity`. A response is
// checked against `cache` as it is before the response's own slot assignments (see above).
RequestList decode_requests(const uint8_t* data, size_t size, int ranks, uint32_t cache_capacity);
ResponseList decode_responses(const uint8_t* data, size_t size, int ranks,
                              const ResponseCache& cache);

}  // namespace kolo::fusion
