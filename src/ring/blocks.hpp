// Where the data of each rank lies in the buffers of allgather(v), reduce-scatter(v) and
// alltoall(v). Computed (and validated) by the communicator before anything is sent, and the same
// on every rank for the collectives whose ranks must agree on it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kolo {

// Rank r's block: counts[r] elements at element offset offsets[r] of a buffer that holds every
// rank's block in rank order, back to back (total elements in all).
struct Blocks {
  std::vector<uint64_t> counts;
  std::vector<uint64_t> offsets;
  uint64_t total = 0;

  static Blocks equal(uint64_t count, int ranks) {
    return from_counts(std::vector<uint64_t>(static_cast<size_t>(ranks), count));
  }
  // The caller has checked that the sum fits.
  static Blocks from_counts(std::span<const uint64_t> counts) {
    Blocks blocks;
    blocks.counts.assign(counts.begin(), counts.end());
    for (uint64_t count : counts) {
      blocks.offsets.push_back(blocks.total);
      blocks.total += count;
    }
    return blocks;
  }
  int ranks() const { return static_cast<int>(counts.size()); }
};

// A 64-bit digest of a count vector, carried in the descriptor so that ranks that pass different
// vectors to a v-collective disagree visibly (splitmix64 steps; not cryptographic).
inline uint64_t hash_counts(std::span<const uint64_t> counts) {
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  uint64_t hash = mix(counts.size());
  for (uint64_t count : counts) hash = mix(hash ^ count);
  return hash == 0 ? 1 : hash;  // 0 means "nothing more to agree on"
}

// alltoall(v): what this rank sends to and receives from each peer, in elements. Send data for
// peer p is send_counts[p] elements at send_offsets[p] of sendbuf; data from peer p lands at
// recv_offsets[p] of recvbuf.
struct AlltoallLayout {
  std::vector<uint64_t> send_counts;
  std::vector<uint64_t> send_offsets;
  std::vector<uint64_t> recv_counts;
  std::vector<uint64_t> recv_offsets;
};

}  // namespace kolo
