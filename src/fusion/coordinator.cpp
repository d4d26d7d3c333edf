#include "fusion/coordinator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <list>
#include <optional>

#include "core/log.hpp"

namespace kolo::fusion {
namespace {

constexpr uint64_t kNeverUsed = ~uint64_t{0};
constexpr size_t kStalledTensorsShown = 5;

bool bit_set(const RequestList& list, uint32_t slot) {
  size_t word = slot / 64;
  return word < list.ready_words.size() && ((list.ready_words[word] >> (slot % 64)) & 1) != 0;
}

double seconds(Clock::duration duration) {
  return std::chrono::duration<double>(duration).count();
}

}  // namespace

std::string format_ranks(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) text += ", ";
    if (j >= i + 2) {
      text += fmt::format("{}-{}", ranks[i], ranks[j]);
      i = j + 1;
    } else {
      text += fmt::format("{}", ranks[i]);
      ++i;
    }
  }
  return text;
}

Coordinator::Coordinator(const CoordinatorSettings& settings, const ResponseCache& cache)
    : settings_(settings),
      cache_(cache),
      last_used_(cache.capacity(), kNeverUsed),
      newer_(cache.capacity(), kNoSlot),
      older_(cache.capacity(), kNoSlot),
      joined_(static_cast<size_t>(settings.ranks), false) {}

bool Coordinator::complete(const Entry& entry) const {
  int counted = entry.submitted;
  for (int rank = 0; rank < settings_.ranks; ++rank) {
    if (joined_[rank] && entry.spec_of_rank[rank] < 0) ++counted;
  }
  return entry.submitted > 0 && counted == settings_.ranks;
}

template <typename Submitted>
std::string Coordinator::joined_broadcast_problem(const UnitSpec& spec,
                                                  Submitted submitted) const {
  if (spec.kind != Kind::kBroadcast || joined_count_ == 0) return "";
  if (joined_[spec.root] && !submitted(spec.root)) {
    return fmt::format(
        "broadcast '{}' from rank {}, which has called kolo_join: a rank that has joined has no "
        "data to broadcast",
        spec.members.front().name, spec.root);
  }
  std::vector<int> missing;
  for (int rank = 0; rank < settings_.ranks; ++rank) {
    if (joined_[rank] && !submitted(rank)) missing.push_back(rank);
  }
  if (missing.empty()) return "";
  return fmt::format(
      "broadcast '{}' from rank {}: rank{} {} ha{} called kolo_join and would not receive it; a "
      "broadcast needs every rank",
      spec.members.front().name, spec.root, missing.size() > 1 ? "s" : "",
      fmt::join(missing, ", "), missing.size() > 1 ? "ve" : "s");
}

Coordinator::Entry& Coordinator::entry_for(const std::string& key, Clock::time_point now) {
  auto [it, created] = ledger_.try_emplace(key);
  if (created) {
    it->second.spec_of_rank.assign(settings_.ranks, -1);
    it->second.arrived.assign(settings_.ranks, Clock::time_point{});
    it->second.first_seen = now;
    it->second.order = next_order_++;
  }
  return it->second;
}

void Coordinator::record(Entry& entry, int rank, const UnitSpec& spec, Clock::time_point now) {
  if (entry.spec_of_rank[rank] >= 0) return;  // a cached unit's bit repeats every cycle
  const UnitSpec* compared = &spec;
  UnitSpec agreed;
  if (spec.kind == Kind::kAllgather) {
    agreed = agreed_part(spec);
    compared = &agreed;
    if (entry.gather_counts.empty()) {
      entry.gather_counts.assign(settings_.ranks, 0);
      entry.capacities.assign(settings_.ranks, 0);
    }
    entry.gather_counts[rank] = spec.members.front().count;
    entry.capacities[rank] = spec.recv_capacity;
  }
  auto known = std::find(entry.specs.begin(), entry.specs.end(), *compared);
  if (known == entry.specs.end()) known = entry.specs.insert(entry.specs.end(), *compared);
  entry.spec_of_rank[rank] = static_cast<int32_t>(known - entry.specs.begin());
  entry.arrived[rank] = now;
  ++entry.submitted;
}

std::string Coordinator::mismatch_message(const std::string& key, const Entry& entry) const {
  std::string text = fmt::format("ranks disagree about tensor '{}': ", key);
  for (size_t i = 0; i < entry.specs.size(); ++i) {
    std::vector<int> ranks;
    for (int rank = 0; rank < settings_.ranks; ++rank) {
      if (entry.spec_of_rank[rank] == static_cast<int32_t>(i)) ranks.push_back(rank);
    }
    if (i > 0) text += i + 1 == entry.specs.size() ? " but " : "; ";
    text += fmt::format("{} submitted {}", format_ranks(ranks), describe(entry.specs[i]));
  }
  return text;
}

std::string Coordinator::capacity_problem(const std::string& key, const Entry& entry) const {
  constexpr size_t kShown = 8;
  const DataType dtype = entry.specs.front().dtype;
  std::string counts;
  for (size_t rank = 0; rank < entry.gather_counts.size(); ++rank) {
    if (rank == kShown) {
      counts += fmt::format(", and {} more ranks", entry.gather_counts.size() - kShown);
      break;
    }
    counts += fmt::format("{}rank {}: {}", rank > 0 ? ", " : "", rank, entry.gather_counts[rank]);
  }
  std::optional<uint64_t> total = gathered_total(entry.gather_counts, dtype);
  if (!total) {
    return fmt::format(
        "allgather '{}' ({}): the counts of all ranks ({}) add up to more "
        "elements than a buffer can hold; nothing was sent",
        key, dtype_name(dtype), counts);
  }
  std::string short_ranks;
  size_t too_small = 0;
  for (size_t rank = 0; rank < entry.capacities.size(); ++rank) {
    if (entry.capacities[rank] >= *total || entry.spec_of_rank[rank] < 0) continue;
    if (too_small++ < kShown) {
      short_ranks += fmt::format("{}{} on rank {}", short_ranks.empty() ? "" : ", ",
                                 entry.capacities[rank], rank);
    }
  }
  if (too_small == 0) return "";
  if (too_small > kShown) short_ranks += fmt::format(" and {} more ranks", too_small - kShown);
  return fmt::format(
      "allgather '{}' ({}): the gathered result needs {} elements ({}) but "
      "recv_capacity is {}; nothing was received on any rank",
      key, dtype_name(dtype), *total, counts, short_ranks);
}

void Coordinator::touch(uint32_t slot, uint64_t cycle) {
  last_used_[slot] = cycle;
  if (slot == newest_) return;
  if (older_[slot] != kNoSlot || slot == oldest_) {  // in the list: take it out
    (older_[slot] == kNoSlot ? oldest_ : newer_[older_[slot]]) = newer_[slot];
    older_[newer_[slot]] = older_[slot];  // not the newest, so it has a newer one
  }
  older_[slot] = newest_;
  newer_[slot] = kNoSlot;
  (newest_ == kNoSlot ? oldest_ : newer_[newest_]) = slot;
  newest_ = slot;
}

int32_t Coordinator::choose_slot(const UnitSpec& spec, uint64_t cycle,
                                 const std::vector<uint32_t>& busy) {
  int32_t slot = cache_.slot_of(spec.key());
  // The key's old slot may have gone to another unit of this cycle already (evicted as the least
  // recently used): the members' caches change only when they apply this response, so giving it
  // out twice would name one slot for two units.
  if (slot >= 0 && last_used_[slot] == cycle) slot = -1;
  if (slot < 0 && never_used_ < cache_.capacity()) slot = static_cast<int32_t>(never_used_++);
  if (slot < 0) {
    for (uint32_t s = oldest_; s != kNoSlot && last_used_[s] < cycle; s = newer_[s]) {
      if (s < busy.size() && busy[s] > 0) continue;
      slot = static_cast<int32_t>(s);
      break;
    }
  }
  if (slot >= 0) touch(static_cast<uint32_t>(slot), cycle);
  return slot;
}

uint64_t Coordinator::padded_bytes(const UnitSpec& spec) const {
  const uint64_t ranks = static_cast<uint64_t>(settings_.ranks);
  uint64_t elements = 0;
  for (const Member& member : spec.members) elements += (member.count + ranks - 1) / ranks * ranks;
  return elements * dtype_size(spec.dtype);
}

void Coordinator::split_ranks(const Entry& entry, std::vector<int>& present,
                              std::vector<int>& missing) const {
  for (int rank = 0; rank < settings_.ranks; ++rank) {
    (entry.spec_of_rank[rank] >= 0 ? present : missing).push_back(rank);
  }
}

std::string Coordinator::waiting_summary(Clock::time_point now) const {
  std::vector<std::pair<double, const std::string*>> oldest;
  for (const auto& [key, entry] : ledger_)
    oldest.emplace_back(seconds(now - entry.first_seen), &key);
  const size_t shown = std::min(oldest.size(), kStalledTensorsShown);
  std::partial_sort(oldest.begin(), oldest.begin() + static_cast<ptrdiff_t>(shown), oldest.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string summary;
  for (size_t i = 0; i < shown; ++i) {
    std::vector<int> present, missing;
    split_ranks(ledger_.at(*oldest[i].second), present, missing);
    summary += fmt::format("{}'{}' for {:.1f} s, missing {}", i == 0 ? "" : "; ", *oldest[i].second,
                           oldest[i].first, format_ranks(missing));
  }
  if (oldest.size() > shown) summary += fmt::format(" (and {} more)", oldest.size() - shown);
  return summary;
}

void Coordinator::check_stalls(Clock::time_point now, ResponseList& response) {
  const double warn_after = settings_.stall_warning_s;
  const double abort_after = settings_.stall_abort_s;
  if (warn_after <= 0 && abort_after <= 0) return;
  struct Stalled {
    double age;
    std::string text;
  };
  std::vector<Stalled> stalled;
  for (auto it = ledger_.begin(); it != ledger_.end();) {
    const Entry& entry = it->second;
    double age = seconds(now - entry.first_seen);
    bool aborting = abort_after > 0 && age >= abort_after;
    if (!aborting && !(warn_after > 0 && age >= warn_after)) {
      ++it;
      continue;
    }
    std::vector<int> present, missing;
    split_ranks(entry, present, missing);
    if (aborting) {
      response.errors.push_back(
          {it->first, Status::kTimeout,
           fmt::format("tensor '{}' stalled: submitted by {} but not by {} within {} s "
                       "(KOLO_STALL_ABORT_S)",
                       it->first, format_ranks(present), format_ranks(missing), abort_after)});
      it = ledger_.erase(it);
      continue;
    }
    stalled.push_back({age, fmt::format("'{}' missing {}", it->first, format_ranks(missing))});
    ++it;
  }
  if (stalled.empty() ||
      (last_warning_ != Clock::time_point{} && seconds(now - last_warning_) < warn_after)) {
    return;
  }
  last_warning_ = now;
  std::sort(stalled.begin(), stalled.end(),
            [](const Stalled& a, const Stalled& b) { return a.age > b.age; });
  std::string list;
  for (size_t i = 0; i < stalled.size() && i < kStalledTensorsShown; ++i) {
    if (i > 0) list += "; ";
    list += stalled[i].text;
  }
  if (stalled.size() > kStalledTensorsShown) {
    list += fmt::format(" (and {} more)", stalled.size() - kStalledTensorsShown);
  }
  log::warn(
      "fusion: {} tensor(s) submitted by some ranks but not by others for more than {} s "
      "(KOLO_STALL_WARNING_S): {}. Every rank must submit the same names; one that never does "
      "stalls the job",
      stalled.size(), warn_after, list);
}

std::vector<Batch> Coordinator::plan(const std::vector<Ready>& ready,
                                     uint64_t fusion_threshold) const {
  auto unit_of = [](const Ready& entry) {
    ResponseUnit unit;
    unit.hit = entry.hit;
    unit.slot = entry.slot;
    if (!entry.hit) unit.spec = *entry.spec;
    return unit;
  };
  std::vector<Batch> batches;
  std::vector<bool> taken(ready.size(), false);
  auto alone = [this](const UnitSpec& spec) {
    return spec.members.size() == 1 && spec.total_bytes() >= alone_bytes_;
  };
  for (size_t i = 0; i < ready.size(); ++i) {
    if (taken[i]) continue;
    taken[i] = true;
    Batch batch;
    batch.units.push_back(unit_of(ready[i]));
    const UnitSpec& first = *ready[i].spec;
    if (fusion_threshold > 0 && first.kind == Kind::kAllreduce && !alone(first)) {
      size_t members = first.members.size();
      uint64_t bytes = padded_bytes(first);
      const uint64_t limit =
          engine_algorithm(first, settings_.ranks) == Algorithm::kRecursiveDoubling
              ? std::min(fusion_threshold, latency_batch_bytes(settings_.ranks))
              : fusion_threshold;
      for (size_t j = i + 1; j < ready.size() && bytes < limit; ++j) {
        if (taken[j] || !fusable(first, *ready[j].spec, settings_.ranks) || alone(*ready[j].spec)) {
          continue;
        }
        uint64_t more = padded_bytes(*ready[j].spec);
        if (bytes + more > limit) continue;
        taken[j] = true;
        bytes += more;
        members += ready[j].spec->members.size();
        batch.units.push_back(unit_of(ready[j]));
      }
      batch.fused = members > 1;
    } else if (settings_.one_ring && fusion_threshold > 0 && first.kind == Kind::kAllreduce &&
               alone(first) && engine_algorithm(first, settings_.ranks) == Algorithm::kRing) {
      // Tensors too large to fuse share one ring allreduce over their own buffers, up to the
      // threshold.
      uint64_t bytes = first.total_bytes();
      for (size_t j = i + 1; j < ready.size() && bytes < fusion_threshold; ++j) {
        if (taken[j] || !alone(*ready[j].spec) ||
            !fusable(first, *ready[j].spec, settings_.ranks)) {
          continue;
        }
        uint64_t more = ready[j].spec->total_bytes();
        if (bytes + more > fusion_threshold) continue;
        taken[j] = true;
        bytes += more;
        batch.units.push_back(unit_of(ready[j]));
      }
      batch.one_ring = batch.units.size() > 1;
    }
    batches.push_back(std::move(batch));
  }
  return batches;
}

ResponseList Coordinator::process(uint64_t cycle, const std::vector<RequestList>& lists,
                                  uint64_t fusion_threshold, Clock::time_point now,
                                  std::vector<Arrival>* arrivals) {
  const int ranks = settings_.ranks;
  ResponseList response;
  std::vector<Ready> ready;
  std::list<UnitSpec> ready_specs;  // specs of ready ledger entries (stable addresses)

  for (int rank = 0; rank < ranks; ++rank) {
    if (lists[rank].joined && !joined_[rank]) {
      joined_[rank] = true;
      ++joined_count_;
      last_joined_ = rank;  // ranks joining in the same cycle: the highest is the last
    }
  }

  for (int rank = 0; rank < ranks; ++rank) {
    for (const UnitSpec& spec : lists[rank].announcements) {
      record(entry_for(spec.key(), now), rank, spec, now);
    }
  }

  // Ready bits: a slot whose bit every rank set is a hit; partial ones join the ledger.
  size_t words = 0;
  for (const RequestList& list : lists) words = std::max(words, list.ready_words.size());
  std::vector<uint32_t> busy(words * 64, 0);
  size_t marked = 0;  // slots with a bit from some rank
  for (int rank = 0; rank < ranks; ++rank) {
    for (size_t w = 0; w < lists[rank].ready_words.size(); ++w) {
      for (uint64_t bits = lists[rank].ready_words[w]; bits != 0; bits &= bits - 1) {
        uint32_t slot = static_cast<uint32_t>(w * 64 + __builtin_ctzll(bits));
        if (!cache_.at(slot)) {
          throw Error(Status::kInternal,
                      fmt::format("rank {} reported a ready unit in cache slot {}, which is "
                                  "empty (the response caches disagree)",
                                  rank, slot));
        }
        if (busy[slot]++ == 0) ++marked;
      }
    }
  }
  ready.reserve(marked + ledger_.size());  // at most every marked slot and every ledger entry
  for (uint32_t slot = 0; slot < busy.size(); ++slot) {
    if (busy[slot] == 0) continue;
    const UnitSpec& spec = *cache_.at(slot);
    auto known = ledger_.find(spec.key());
    uint32_t counted = busy[slot];
    for (int rank = 0; rank < ranks; ++rank) {
      if (joined_[rank] && !bit_set(lists[rank], slot)) ++counted;
    }
    const std::string root_problem = joined_broadcast_problem(
        spec, [&](int rank) { return bit_set(lists[rank], slot); });
    if (known == ledger_.end() && counted == static_cast<uint32_t>(ranks) && root_problem.empty()) {
      ready.push_back({true, static_cast<int32_t>(slot), &spec, now, next_order_++});
      touch(slot, cycle);
      if (arrivals) arrivals->push_back({spec.key(), std::vector<Clock::time_point>(ranks, now)});
      continue;
    }
    Entry& entry = known != ledger_.end() ? known->second : entry_for(spec.key(), now);
    for (int rank = 0; rank < ranks; ++rank) {
      if (bit_set(lists[rank], slot)) record(entry, rank, spec, now);
    }
  }

  // Entries every rank has submitted: ready if they agree, else a mismatch for everyone.
  for (auto it = ledger_.begin(); it != ledger_.end();) {
    Entry& entry = it->second;
    if (!complete(entry)) {
      ++it;
      continue;
    }
    std::string capacity_error;
    if (entry.specs.size() == 1 && entry.specs.front().kind == Kind::kAllgather) {
      capacity_error = capacity_problem(it->first, entry);
      entry.specs.front().gather_counts = std::move(entry.gather_counts);
    }
    if (entry.specs.size() == 1 && capacity_error.empty() &&
        entry.specs.front().kind == Kind::kBroadcast) {
      capacity_error = joined_broadcast_problem(
          entry.specs.front(), [&](int rank) { return entry.spec_of_rank[rank] >= 0; });
    }
    if (!capacity_error.empty()) {
      response.errors.push_back({it->first, Status::kInvalidArgument, std::move(capacity_error)});
    } else if (entry.specs.size() == 1) {
      ready_specs.push_back(std::move(entry.specs.front()));
      int32_t slot = cache_.find(ready_specs.back());
      if (slot >= 0) touch(static_cast<uint32_t>(slot), cycle);
      ready.push_back({slot >= 0, slot, &ready_specs.back(), entry.first_seen, entry.order});
      if (arrivals) arrivals->push_back({it->first, entry.arrived});
    } else {
      response.errors.push_back({it->first, Status::kMismatch, mismatch_message(it->first, entry)});
    }
    it = ledger_.erase(it);
  }
  check_stalls(now, response);

  std::sort(ready.begin(), ready.end(), [](const Ready& a, const Ready& b) {
    return a.first_seen != b.first_seen ? a.first_seen < b.first_seen : a.order < b.order;
  });
  if (cache_.capacity() > 0) {
    for (Ready& entry : ready) {
      // Allgathers are never cached (coordinator.hpp says why).
      if (!entry.hit && entry.spec->kind != Kind::kAllgather) {
        entry.slot = choose_slot(*entry.spec, cycle, busy);
      }
    }
  }
  response.batches = plan(ready, fusion_threshold);
  response.idle = ledger_.empty();
  if (joined_count_ == ranks) {  // everyone has joined: kolo_join returns, and joining starts over
    response.all_joined = last_joined_;
    joined_.assign(joined_.size(), false);
    joined_count_ = 0;
    last_joined_ = -1;
  }
  return response;
}

}  // namespace kolo::fusion
