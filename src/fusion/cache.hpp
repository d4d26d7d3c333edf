// The response cache: negotiated unit specs in numbered slots, the same on every rank.
//
// Only the responses that rank 0 broadcasts change it, and every rank applies them in the same
// order, so slot s means the same unit everywhere and a rank can say "the unit in slot s is ready
// here" with one bit. Rank 0 alone decides which slot a newly negotiated unit takes and what it
// evicts (see coordinator.hpp); this class only stores.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "fusion/spec.hpp"

namespace kolo::fusion {

class ResponseCache {
 public:
  explicit ResponseCache(uint32_t capacity) : slots_(capacity) {}

  uint32_t capacity() const { return static_cast<uint32_t>(slots_.size()); }
  uint32_t size() const { return static_cast<uint32_t>(by_key_.size()); }

  // The slot that holds a unit with this key, or -1.
  int32_t slot_of(const std::string& key) const {
    auto it = by_key_.find(key);
    return it == by_key_.end() ? -1 : static_cast<int32_t>(it->second);
  }
  // The slot that holds exactly this spec, or -1.
  int32_t find(const UnitSpec& spec) const {
    int32_t slot = slot_of(spec.key());
    return slot >= 0 && *slots_[slot] == spec ? slot : -1;
  }
  const UnitSpec* at(uint32_t slot) const {
    return slot < slots_.size() && slots_[slot] ? &*slots_[slot] : nullptr;
  }
  // A slot that holds nothing, or -1 when the cache is full.
  int32_t free_slot() const {
    if (!holes_.empty()) return static_cast<int32_t>(holes_.back());
    return next_unused_ < slots_.size() ? static_cast<int32_t>(next_unused_) : -1;
  }

  // Puts spec in slot, evicting what was there; a unit with the same key in another slot leaves
  // that slot.
  void store(uint32_t slot, const UnitSpec& spec);

 private:
  void forget(uint32_t slot);

  std::vector<std::optional<UnitSpec>> slots_;
  std::unordered_map<std::string, uint32_t> by_key_;
  uint32_t next_unused_ = 0;     // slots at or above it were never used
  std::vector<uint32_t> holes_;  // emptied slots below next_unused_
};

}  // namespace kolo::fusion
