#include "fusion/wire.hpp"

#include <fmt/format.h>

#include <cstring>

#include "core/config.hpp"

namespace kolo::fusion {
namespace {

constexpr uint8_t kUnitHit = 1;
constexpr uint8_t kUnitNew = 2;
constexpr uint8_t kSettingsTag = 1;
// What a batch's first byte says: its units run one after the other, fused, or on one ring.
constexpr uint8_t kBatchApart = 0;
constexpr uint8_t kBatchFused = 1;
constexpr uint8_t kBatchOneRing = 2;  // the only section that may follow a response's batches

class Writer {
 public:
  explicit Writer(std::vector<uint8_t>& out) : out_(out) { out_.clear(); }
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &value, sizeof(T));
  }
  void put_string(const std::string& text) {
    put<uint32_t>(static_cast<uint32_t>(text.size()));
    out_.insert(out_.end(), text.begin(), text.end());
  }
  void put_spec(const UnitSpec& spec) {
    put<uint8_t>(static_cast<uint8_t>(spec.kind));
    put<uint8_t>(static_cast<uint8_t>(spec.dtype));
    put<uint8_t>(static_cast<uint8_t>(spec.op));
    put<int32_t>(spec.root);
    put<double>(spec.prescale);
    put<double>(spec.postscale);
    put<uint32_t>(static_cast<uint32_t>(spec.members.size()));
    for (const Member& member : spec.members) {
      put_string(member.name);
      put<uint64_t>(member.count);
    }
    if (spec.kind == Kind::kAllgather) {
      put<uint64_t>(spec.recv_capacity);
      put<uint32_t>(static_cast<uint32_t>(spec.gather_counts.size()));
      for (uint64_t count : spec.gather_counts) put<uint64_t>(count);
    }
  }

 private:
  std::vector<uint8_t>& out_;
};

class Reader {
 public:
  Reader(const uint8_t* data, size_t size, int ranks, uint32_t capacity)
      : data_(data), size_(size), ranks_(ranks), capacity_(capacity) {}

  [[noreturn]] void malformed(const std::string& what) const {
    throw Error(
        Status::kInternal,
        fmt::format("malformed negotiation message ({} at byte {} of {})", what, at_, size_));
  }
  template <typename T>
  T get(const char* what) {
    if (size_ - at_ < sizeof(T)) malformed(fmt::format("truncated {}", what));
    T value;
    std::memcpy(&value, data_ + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }
  // A count of items of at least item_bytes each: bounded by what is left and by limit.
  uint32_t get_count(const char* what, size_t item_bytes, size_t limit) {
    uint32_t count = get<uint32_t>(what);
    if (count > limit || static_cast<uint64_t>(count) * item_bytes > size_ - at_) {
      malformed(fmt::format("{} {} out of bounds", what, count));
    }
    return count;
  }
  std::string get_string(const char* what, size_t limit) {
    uint32_t length = get_count(what, 1, limit);
    std::string text(reinterpret_cast<const char*>(data_ + at_), length);
    at_ += length;
    return text;
  }
  // A submitted spec (an announcement) carries no gathered counts; a scheduled one (in a
  // response) carries one per rank if it is an allgather.
  UnitSpec get_spec(bool scheduled) {
    UnitSpec spec;
    spec.kind = static_cast<Kind>(get<uint8_t>("kind"));
    spec.dtype = static_cast<DataType>(get<uint8_t>("dtype"));
    spec.op = static_cast<ReduceOp>(get<uint8_t>("op"));
    spec.root = get<int32_t>("root");
    spec.prescale = get<double>("prescale");
    spec.postscale = get<double>("postscale");
    uint32_t members = get_count("member count", 4 + 1 + 8, kMaxGroupMembers);
    spec.members.resize(members);
    for (Member& member : spec.members) {
      member.name = get_string("name length", kMaxNameBytes);
      member.count = get<uint64_t>("count");
    }
    if (spec.kind == Kind::kAllgather) {
      spec.recv_capacity = get<uint64_t>("receive capacity");
      uint32_t counts = get_count("gathered count", 8, static_cast<size_t>(ranks_));
      spec.gather_counts.resize(counts);
      for (uint64_t& count : spec.gather_counts) count = get<uint64_t>("gathered count");
      if (counts != (scheduled ? static_cast<uint32_t>(ranks_) : 0u)) {
        malformed(fmt::format("an allgather {} with {} gathered counts",
                              scheduled ? "scheduled" : "announced", counts));
      }
    }
    if (std::string problem = check_spec(spec, ranks_); !problem.empty()) malformed(problem);
    return spec;
  }
  int32_t get_slot(bool allow_none) {
    int32_t slot = get<int32_t>("slot");
    if ((slot < 0 && !(allow_none && slot == -1)) ||
        (slot >= 0 && static_cast<uint32_t>(slot) >= capacity_)) {
      malformed(fmt::format("cache slot {} outside a cache of {}", slot, capacity_));
    }
    return slot;
  }
  bool at_end() const { return at_ == size_; }
  void expect_end() const {
    if (at_ != size_) malformed(fmt::format("{} bytes left over", size_ - at_));
  }
  uint32_t capacity() const { return capacity_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
  int ranks_;
  uint32_t capacity_;
};

// The settings section of a response, every value within what its variable accepts.
EngineSettings read_settings(Reader& reader) {
  uint8_t tag = reader.get<uint8_t>("section tag");
  if (tag != kSettingsTag) reader.malformed(fmt::format("section tag {} after the batches", tag));
  EngineSettings settings;
  settings.fusion_threshold = reader.get<uint64_t>("fusion threshold");
  if (settings.fusion_threshold > kMaxFusionThresholdBytes) {
    reader.malformed(fmt::format("fusion threshold {}", settings.fusion_threshold));
  }
  settings.cycle_time_ms = reader.get<double>("cycle time");
  if (!(settings.cycle_time_ms > 0 && settings.cycle_time_ms <= kMaxCycleTimeMs)) {
    reader.malformed(fmt::format("cycle time {} ms", settings.cycle_time_ms));
  }
  settings.segment_bytes = reader.get<uint64_t>("segment size");
  if (settings.segment_bytes < kSmallestSegmentBytes ||
      settings.segment_bytes > kLargestSegmentBytes) {
    reader.malformed(fmt::format("segment size {}", settings.segment_bytes));
  }
  uint8_t final = reader.get<uint8_t>("final flag");
  if (final > 1) reader.malformed("final flag");
  settings.final = final == 1;
  return settings;
}

}  // namespace

size_t encoded_size(const UnitSpec& spec) {
  size_t bytes = 3 + 4 + 8 + 8 + 4;
  for (const Member& member : spec.members) bytes += 4 + member.name.size() + 8;
  if (spec.kind == Kind::kAllgather) bytes += 8 + 4 + 8 * spec.gather_counts.size();
  return bytes;
}

void encode(const RequestList& list, std::vector<uint8_t>& out) {
  Writer writer(out);
  size_t words = list.ready_words.size();
  while (words > 0 && list.ready_words[words - 1] == 0) --words;
  writer.put<uint32_t>(static_cast<uint32_t>(words));
  for (size_t i = 0; i < words; ++i) writer.put<uint64_t>(list.ready_words[i]);
  writer.put<uint32_t>(static_cast<uint32_t>(list.announcements.size()));
  for (const UnitSpec& spec : list.announcements) writer.put_spec(spec);
  writer.put<uint8_t>(list.joined ? 1 : 0);
}

RequestList decode_requests(const uint8_t* data, size_t size, int ranks, uint32_t cache_capacity) {
  Reader reader(data, size, ranks, cache_capacity);
  RequestList list;
  uint32_t words = reader.get_count("bit words", 8, (cache_capacity + 63) / 64);
  list.ready_words.resize(words);
  for (uint64_t& word : list.ready_words) word = reader.get<uint64_t>("bit word");
  if (words > 0 && cache_capacity % 64 != 0 && words == (cache_capacity + 63) / 64 &&
      (list.ready_words.back() >> (cache_capacity % 64)) != 0) {
    reader.malformed("a ready bit beyond the cache capacity");
  }
  uint32_t count = reader.get_count("announcement count", 27, ~uint32_t{0});
  for (uint32_t i = 0; i < count; ++i) list.announcements.push_back(reader.get_spec(false));
  uint8_t joined = reader.get<uint8_t>("joined flag");
  if (joined > 1) reader.malformed("joined flag");
  list.joined = joined == 1;
  reader.expect_end();
  return list;
}

void encode(const ResponseList& list, std::vector<uint8_t>& out) {
  Writer writer(out);
  writer.put<uint8_t>(list.idle ? 1 : 0);
  writer.put<int32_t>(list.all_joined);
  writer.put<uint32_t>(static_cast<uint32_t>(list.errors.size()));
  for (const ResponseError& error : list.errors) {
    writer.put_string(error.key);
    writer.put<int32_t>(static_cast<int32_t>(error.status));
    writer.put_string(error.message.substr(0, kMaxErrorText));
  }
  writer.put<uint32_t>(static_cast<uint32_t>(list.batches.size()));
  for (const Batch& batch : list.batches) {
    writer.put<uint8_t>(batch.fused ? kBatchFused : batch.one_ring ? kBatchOneRing : kBatchApart);
    writer.put<uint32_t>(static_cast<uint32_t>(batch.units.size()));
    for (const ResponseUnit& unit : batch.units) {
      writer.put<uint8_t>(unit.hit ? kUnitHit : kUnitNew);
      writer.put<int32_t>(unit.slot);
      if (!unit.hit) writer.put_spec(unit.spec);
    }
  }
  if (list.settings) {
    writer.put<uint8_t>(kSettingsTag);
    writer.put<uint64_t>(list.settings->fusion_threshold);
    writer.put<double>(list.settings->cycle_time_ms);
    writer.put<uint64_t>(list.settings->segment_bytes);
    writer.put<uint8_t>(list.settings->final ? 1 : 0);
  }
}

ResponseList decode_responses(const uint8_t* data, size_t size, int ranks,
                              const ResponseCache& cache) {
  Reader reader(data, size, ranks, cache.capacity());
  ResponseList list;
  uint8_t idle = reader.get<uint8_t>("idle flag");
  if (idle > 1) reader.malformed("idle flag");
  list.idle = idle == 1;
  list.all_joined = reader.get<int32_t>("last joined rank");
  if (list.all_joined < -1 || list.all_joined >= ranks) {
    reader.malformed(fmt::format("last joined rank {}", list.all_joined));
  }
  uint32_t errors = reader.get_count("error count", 12, ~uint32_t{0});
  for (uint32_t e = 0; e < errors; ++e) {
    ResponseError& error = list.errors.emplace_back();
    error.key = reader.get_string("key length", kMaxNameBytes);
    int32_t status = reader.get<int32_t>("status");
    if (!status_from_wire(status, error.status) || error.status == Status::kSuccess) {
      reader.malformed(fmt::format("status {}", status));
    }
    error.message = reader.get_string("message length", kMaxErrorText);
  }
  // Each slot at most once: so a response holds at most one hit per slot, whatever its size.
  std::vector<bool> slot_named;
  uint32_t batches = reader.get_count("batch count", 5, ~uint32_t{0});
  for (uint32_t b = 0; b < batches; ++b) {
    Batch& batch = list.batches.emplace_back();
    uint8_t kind = reader.get<uint8_t>("batch kind");
    if (kind > kBatchOneRing) reader.malformed(fmt::format("batch kind {}", kind));
    batch.fused = kind == kBatchFused;
    batch.one_ring = kind == kBatchOneRing;
    uint32_t units = reader.get_count("unit count", 5, ~uint32_t{0});
    if (units == 0) reader.malformed("an empty batch");
    for (uint32_t u = 0; u < units; ++u) {
      ResponseUnit& unit = batch.units.emplace_back();
      uint8_t type = reader.get<uint8_t>("unit type");
      if (type != kUnitHit && type != kUnitNew) reader.malformed(fmt::format("unit type {}", type));
      unit.hit = type == kUnitHit;
      unit.slot = reader.get_slot(!unit.hit);
      if (unit.slot >= 0) {
        if (slot_named.empty()) slot_named.resize(cache.capacity());
        if (slot_named[unit.slot]) reader.malformed(fmt::format("cache slot {} twice", unit.slot));
        slot_named[unit.slot] = true;
      }
      if (!unit.hit) unit.spec = reader.get_spec(true);
      if (!unit.hit && unit.spec.kind == Kind::kAllgather && (unit.slot != -1 || batch.fused)) {
        reader.malformed("an allgather that is cached or fused");  // neither ever is
      }
      const UnitSpec* spec = spec_of(unit, cache);
      if (spec == nullptr) {
        reader.malformed(fmt::format("a hit in cache slot {}, which is empty", unit.slot));
      }
      // Every unit against the first, the first against itself (an allreduce).
      const UnitSpec* first = spec_of(batch.units.front(), cache);
      if (batch.fused && !fusable(*first, *spec, ranks)) {
        reader.malformed(
            fmt::format("a fused batch of {} and {}", describe(*first), describe(*spec)));
      }
      if (batch.one_ring &&
          (!fusable(*first, *spec, ranks) || engine_algorithm(*spec, ranks) != Algorithm::kRing)) {
        reader.malformed(
            fmt::format("one ring's batch of {} and {}", describe(*first), describe(*spec)));
      }
    }
  }
  if (!reader.at_end()) list.settings = read_settings(reader);
  reader.expect_end();
  return list;
}

}  // namespace kolo::fusion
