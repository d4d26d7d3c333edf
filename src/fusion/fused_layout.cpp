#include "fusion/fused_layout.hpp"

#include <cstring>

namespace kolo::fusion {

FusedLayout::FusedLayout(const std::vector<uint64_t>& counts, int ranks)
    : counts_(counts),
      ranks_(ranks),
      offsets_(counts.size() * static_cast<size_t>(ranks)),
      used_(static_cast<size_t>(ranks), 0) {
  for (size_t m = 0; m < counts_.size(); ++m) {
    for (int c = 0; c < ranks_; ++c) {
      offsets_[m * static_cast<size_t>(ranks_) + static_cast<size_t>(c)] = used_[c];
      used_[c] += chunk_size(counts_[m], ranks_, c);
    }
  }
  chunk_elements_ = used_.empty() ? 0 : used_[0];  // chunk 0 is the longest of every tensor
}

void FusedLayout::copy_in(size_t member, const void* tensor, void* buffer,
                          size_t element_bytes) const {
  const auto* from = static_cast<const std::byte*>(tensor);
  auto* to = static_cast<std::byte*>(buffer);
  for (int c = 0; c < ranks_; ++c) {
    uint64_t size = chunk_size(counts_[member], ranks_, c);
    if (size == 0) continue;
    std::memcpy(to + offset(member, c) * element_bytes,
                from + chunk_begin(counts_[member], ranks_, c) * element_bytes,
                size * element_bytes);
  }
}

void FusedLayout::copy_out(size_t member, const void* buffer, void* tensor,
                           size_t element_bytes) const {
  const auto* from = static_cast<const std::byte*>(buffer);
  auto* to = static_cast<std::byte*>(tensor);
  for (int c = 0; c < ranks_; ++c) {
    uint64_t size = chunk_size(counts_[member], ranks_, c);
    if (size == 0) continue;
    std::memcpy(to + chunk_begin(counts_[member], ranks_, c) * element_bytes,
                from + offset(member, c) * element_bytes, size * element_bytes);
  }
}

void FusedLayout::zero_padding(void* buffer, size_t element_bytes) const {
  auto* bytes = static_cast<std::byte*>(buffer);
  for (int c = 0; c < ranks_; ++c) {
    uint64_t begin = static_cast<uint64_t>(c) * chunk_elements_ + used_[c];
    uint64_t end = static_cast<uint64_t>(c + 1) * chunk_elements_;
    if (end > begin) std::memset(bytes + begin * element_bytes, 0, (end - begin) * element_bytes);
  }
}

}  // namespace kolo::fusion
