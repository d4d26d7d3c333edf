// The layout of the segment that two ranks of one host share (shm_channel.hpp says how it is made
// and used): a header page with each direction's counters, then the two rings' data. Only
// shm_channel.cpp reads and writes it; tests/fuzz/shm_ring.cpp writes it as a hostile peer would.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

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

}  // namespace kolo::shm
