#include "fusion/cache.hpp"

#include <algorithm>

namespace kolo::fusion {

void ResponseCache::forget(uint32_t slot) {
  if (!slots_[slot]) return;
  by_key_.erase(slots_[slot]->key());
  slots_[slot].reset();
  holes_.push_back(slot);
}

void ResponseCache::store(uint32_t slot, const UnitSpec& spec) {
  if (slot >= slots_.size()) return;
  int32_t previous = slot_of(spec.key());
  if (previous >= 0 && static_cast<uint32_t>(previous) != slot) forget(previous);
  if (slots_[slot]) by_key_.erase(slots_[slot]->key());
  if (slot >= next_unused_) {
    for (uint32_t unused = next_unused_; unused < slot; ++unused) holes_.push_back(unused);
    next_unused_ = slot + 1;
  }
  holes_.erase(std::remove(holes_.begin(), holes_.end(), slot), holes_.end());
  slots_[slot] = spec;
  by_key_[spec.key()] = slot;
}

}  // namespace kolo::fusion
