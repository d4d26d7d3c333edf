// Where each tensor of a fused allreduce lives in the fusion buffer, and why fused results are
// bitwise identical to unfused ones.
//
// The ring allreduce (src/ring/allreduce.cpp) cuts its buffer into N chunks, and the reduction of
// an element in chunk c starts at rank c and travels c, c+1, ..., c-1: the order in which the N
// contributions are combined depends on the chunk. Floating-point addition is not associative, so
// an element reduced in another chunk may differ in the last bit. Packing tensors one after the
// other would move chunk boundaries and change results.
//
// So the fusion buffer is laid out chunk-major. With S = sum over tensors of ceil(count / N), the
// buffer holds N * S elements, and region c = [c*S, (c+1)*S) holds chunk c of the first tensor,
// then chunk c of the second, and so on, zero padding to S. The chunks are cut exactly as the ring
// would cut each tensor alone (the first count % N chunks one element longer). The ring cuts an
// N*S-element buffer into N chunks of exactly S, which are these regions: every element lands in
// the same chunk as when its tensor is reduced alone, is combined with the same contributions in
// the same order by the same kernels (which work element by element), and so comes out bitwise
// the same, for every dtype, op and factor. The padding costs at most one element per tensor and
// chunk, and the fused collective keeps the ring's bandwidth optimality.
//
// Copying in is N memcpy calls per tensor instead of one; copying out likewise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kolo::fusion {

// Chunk c of a count-element buffer on `ranks` ranks, as the ring allreduce cuts it.
inline uint64_t chunk_begin(uint64_t count, int ranks, int chunk) {
  const uint64_t n = static_cast<uint64_t>(ranks), c = static_cast<uint64_t>(chunk);
  return c * (count / n) + (c < count % n ? c : count % n);
}
inline uint64_t chunk_size(uint64_t count, int ranks, int chunk) {
  const uint64_t n = static_cast<uint64_t>(ranks);
  return count / n + (static_cast<uint64_t>(chunk) < count % n ? 1 : 0);
}

class FusedLayout {
 public:
  FusedLayout(const std::vector<uint64_t>& counts, int ranks);

  uint64_t chunk_elements() const { return chunk_elements_; }
  uint64_t total_elements() const { return chunk_elements_ * static_cast<uint64_t>(ranks_); }
  size_t members() const { return counts_.size(); }

  // Copies member m's count elements from `tensor` to its places in `buffer`.
  void copy_in(size_t member, const void* tensor, void* buffer, size_t element_bytes) const;
  // Copies member m's places in `buffer` back to `tensor`.
  void copy_out(size_t member, const void* buffer, void* tensor, size_t element_bytes) const;
  // Zeroes the padding at the end of each chunk region.
  void zero_padding(void* buffer, size_t element_bytes) const;

 private:
  uint64_t offset(size_t member, int chunk) const {
    return static_cast<uint64_t>(chunk) * chunk_elements_ +
           offsets_[member * static_cast<size_t>(ranks_) + static_cast<size_t>(chunk)];
  }

  std::vector<uint64_t> counts_;
  int ranks_;
  uint64_t chunk_elements_ = 0;
  std::vector<uint64_t> offsets_;  // [member][chunk]: offset within the chunk region
  std::vector<uint64_t> used_;     // [chunk]: elements of region c that hold data
};

}  // namespace kolo::fusion
