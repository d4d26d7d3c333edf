// The layout of the segment that two ranks of one host share (shm_channel.hpp says how it is made
// and used): a header page with each direction's counters, then the two rings' data. Only
// shm_channel.cpp reads and writes it; tests/fuzz/shm_ring.cpp writes it as a hostile peer would.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/op_descriptor.hpp"
#include "transport/shm/shm_channel.hpp"

namespace kolo::shm {

inline constexpr size_t kCacheLine = 64;
inline constexpr size_t kCapacity = ShmChannel::kSlotBytes * ShmChannel::kSlots;  // of one ring
inline constexpr size_t kHeaderPage = 4096;
inline constexpr size_t kSegmentBytes = kHeaderPage + 2 * kCapacity;

// One direction's counters, each on its own cache line so that producer and consumer do not
// share one.
struct RingCounters {
  alignas(kCacheLine) std::atomic<uint64_t> head;  // bytes published by the producer
  alignas(kCacheLine) std::atomic<uint64_t> tail;  // bytes consumed by the consumer
  alignas(kCacheLine) std::atomic<uint32_t> consumer_waiting;
  alignas(kCacheLine) std::atomic<uint32_t> producer_waiting;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "counters must be address-free");

struct SegmentHeader {
  uint64_t magic;
  uint64_t cookie;
  uint64_t slot_bytes;
  uint64_t slots;
  RingCounters rings[2];  // 0: lower rank to higher, 1: higher to lower
};
static_assert(sizeof(SegmentHeader) <= kHeaderPage);

// The data of ring `ring` (0 or 1) of a segment mapped at `segment`.
inline char* ring_data(void* segment, int ring) {
  return static_cast<char*>(segment) + kHeaderPage + static_cast<size_t>(ring) * kCapacity;
}

// ---- the lines that open messages (shm_channel.hpp, "Messages") ---------------------------------
//
// Every message begins on a cache line of the ring whose first word, stored last and atomically,
// says that the message is there: its kind; a length (a small message's payload, or how much of a
// large message's payload was written before the word, so that the consumer needs no counter for
// it); and a stamp, the line's number in the ring's stream plus one (42 bits). Every lap writes
// every line's first word (a message's word, or payload that is cleared before a message ends
// there), so a line holds this lap's word, zero, or last lap's; the stamp tells which.
// The rest of the line is a SmallBody (a small message, whole) or a LargeBody (a frame header;
// the payload follows on the next lines, then published by `head`).
inline constexpr size_t kLines = kCapacity / kCacheLine;
inline constexpr size_t kSmallBytes = 40;  // the most payload a small message carries
inline constexpr int kLengthBits = 20;     // a length in a word: up to a slot (2^18 bytes)
inline constexpr uint64_t kLengthMask = (uint64_t{1} << kLengthBits) - 1;
inline constexpr int kStampShift = 2 + kLengthBits;
inline constexpr uint64_t kStampMask = (uint64_t{1} << (64 - kStampShift)) - 1;
static_assert((kStampMask + 1) % kLines == 0,
              "a line's stamps repeat a whole number of laps apart");
static_assert(ShmChannel::kSlotBytes <= kLengthMask, "a piece's length fits a word");

enum class LineKind : uint64_t { kSmall = 1, kLarge = 2 };

inline uint64_t line_stamp(uint64_t at) {
  return (at / kCacheLine + 1) & kStampMask;
}
// The first word of a message that begins at byte `at` of the stream (a multiple of kCacheLine).
inline uint64_t line_word(uint64_t at, LineKind kind, uint64_t length = 0) {
  return line_stamp(at) << kStampShift | (length & kLengthMask) << 2 | static_cast<uint64_t>(kind);
}

// What the first word of the line at `at` says to the consumer that waits there for a message.
enum class Arrival {
  kNone,     // nothing yet: zero (cleared) or the stamp of this line in an earlier lap
  kSmall,    // a small message of `length` bytes
  kLarge,    // a frame header, and `length` bytes of its payload after it
  kCorrupt,  // no word the producer writes there
};
inline Arrival classify(uint64_t word, uint64_t at, uint64_t& length) {
  if (word == 0) return Arrival::kNone;
  const uint64_t kind = word & 3, stamp = word >> kStampShift, expected = line_stamp(at);
  length = word >> 2 & kLengthMask;
  if (kind != static_cast<uint64_t>(LineKind::kSmall) &&
      kind != static_cast<uint64_t>(LineKind::kLarge)) {
    return Arrival::kCorrupt;
  }
  if (stamp != expected) {
    return stamp % kLines == expected % kLines ? Arrival::kNone : Arrival::kCorrupt;
  }
  if (kind == static_cast<uint64_t>(LineKind::kLarge)) {
    return length <= ShmChannel::kSlotBytes ? Arrival::kLarge : Arrival::kCorrupt;
  }
  return length <= kSmallBytes ? Arrival::kSmall : Arrival::kCorrupt;
}

// The first word of the line at `at` of a ring's data, read and written only atomically while
// the line may be in use by both sides (payload copies reach it only when the counters say they
// own the line). The ring's data is page-aligned, so every line's word is aligned.
inline std::atomic_ref<uint64_t> line_word_at(char* ring, uint64_t at) {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(ring + at % kCapacity));
}

// A small message: a compact descriptor and the payload, in the 56 bytes after the word.
struct SmallBody {
  uint8_t collective;
  uint8_t dtype;
  uint8_t op;
  uint8_t algorithm;
  int32_t root;
  uint32_t count;
  uint32_t sequence;
  uint8_t payload[kSmallBytes];
};
static_assert(sizeof(SmallBody) == kCacheLine - sizeof(uint64_t));

// A frame header without its magic (the word takes its place).
struct LargeBody {
  uint64_t bytes;
  OpDescriptor descriptor;
};
static_assert(sizeof(LargeBody) == kCacheLine - sizeof(uint64_t));

// Whether a SmallBody holds `descriptor` exactly: no scale factors, no detail, count and sequence
// within 32 bits. Other messages of up to kSmallBytes go as large ones.
inline bool fits_small(const OpDescriptor& descriptor) {
  return descriptor.prescale == 1.0 && descriptor.postscale == 1.0 && descriptor.detail == 0 &&
         descriptor.count <= UINT32_MAX && descriptor.sequence <= UINT32_MAX;
}
inline SmallBody small_body(const OpDescriptor& descriptor) {
  SmallBody body{};
  body.collective = static_cast<uint8_t>(descriptor.collective);
  body.dtype = static_cast<uint8_t>(descriptor.dtype);
  body.op = static_cast<uint8_t>(descriptor.op);
  body.algorithm = static_cast<uint8_t>(descriptor.algorithm);
  body.root = descriptor.root;
  body.count = static_cast<uint32_t>(descriptor.count);
  body.sequence = static_cast<uint32_t>(descriptor.sequence);
  return body;
}
inline OpDescriptor descriptor_of(const SmallBody& body) {
  OpDescriptor descriptor;
  descriptor.collective = static_cast<Collective>(body.collective);
  descriptor.dtype = static_cast<DataType>(body.dtype);
  descriptor.op = static_cast<ReduceOp>(body.op);
  descriptor.algorithm = static_cast<Algorithm>(body.algorithm);
  descriptor.root = body.root;
  descriptor.count = body.count;
  descriptor.sequence = body.sequence;
  return descriptor;
}

}  // namespace kolo::shm
