// Unit tests of the fusion engine's parts that need no network: the fused layout, the
// negotiation messages, the response cache, rank 0's coordinator, and the timeline writer.
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <numeric>
#include <span>
#include <thread>

#include "comm/communicator.hpp"
#include "core/config.hpp"
#include "fusion/autotune.hpp"
#include "fusion/cache.hpp"
#include "fusion/coordinator.hpp"
#include "fusion/engine.hpp"
#include "fusion/fused_layout.hpp"
#include "fusion/fusion_cost.hpp"
#include "fusion/timeline.hpp"
#include "fusion/wire.hpp"
#include "job.hpp"
#include "process.hpp"

using namespace kolo;
using namespace kolo::fusion;

namespace {

UnitSpec gather(const std::string& name, uint64_t count, uint64_t capacity,
                       DataType dtype = DataType::kFloat32) {
  UnitSpec spec;
  spec.kind = Kind::kAllgather;
  spec.dtype = dtype;
  spec.members.push_back({name, count});
  spec.recv_capacity = capacity;
  return spec;
}

bool refused_requests(const std::vector<uint8_t>& bytes, int ranks) {
  try { decode_requests(bytes.data(), bytes.size(), ranks, 64); } catch (const Error& e) {
    return std::string(e.what()).find("malformed") != std::string::npos;
  }
  return false;
}
bool refused_responses(const std::vector<uint8_t>& bytes, int ranks) {
  const ResponseCache empty(64);
  try { decode_responses(bytes.data(), bytes.size(), ranks, empty); } catch (const Error& e) {
    return std::string(e.what()).find("malformed") != std::string::npos;
  }
  return false;
}


UnitSpec allreduce(const std::string& name, uint64_t count, DataType dtype = DataType::kFloat32,
                   ReduceOp op = ReduceOp::kSum) {
  UnitSpec spec;
  spec.dtype = dtype;
  spec.op = op;
  spec.members.push_back({name, count});
  return spec;
}

RequestList announcing(std::vector<UnitSpec> specs) {
  RequestList list;
  list.announcements = std::move(specs);
  return list;
}

RequestList with_bits(std::vector<uint32_t> slots) {
  RequestList list;
  for (uint32_t slot : slots) {
    if (list.ready_words.size() <= slot / 64) list.ready_words.resize(slot / 64 + 1, 0);
    list.ready_words[slot / 64] |= uint64_t{1} << (slot % 64);
  }
  return list;
}

// Applies a response's cache assignments, as every rank does.
void apply(ResponseCache& cache, const ResponseList& response) {
  for (const Batch& batch : response.batches) {
    for (const ResponseUnit& unit : batch.units) {
      if (!unit.hit && unit.slot >= 0) cache.store(static_cast<uint32_t>(unit.slot), unit.spec);
    }
  }
}

const Clock::time_point kStart = Clock::now();
Clock::time_point at(double seconds) {
  return kStart +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

TEST_CASE("the fused layout puts every element in the chunk the ring gives it alone",
          "[fusion_units]") {
  const std::vector<uint64_t> counts = {0, 1, 2, 3, 7, 100, 13, 64};
  for (int ranks = 1; ranks <= 5; ++ranks) {
    DYNAMIC_SECTION("N = " << ranks) {
      FusedLayout layout(counts, ranks);
      uint64_t expected_chunk = 0;
      for (uint64_t count : counts) expected_chunk += (count + ranks - 1) / ranks;
      REQUIRE(layout.chunk_elements() == expected_chunk);
      REQUIRE(layout.total_elements() == expected_chunk * ranks);
      // Tensors of (member << 32 | index), copied in: check where each element went.
      std::vector<std::vector<uint64_t>> tensors(counts.size());
      std::vector<uint64_t> buffer(layout.total_elements(), ~uint64_t{0});
      for (size_t m = 0; m < counts.size(); ++m) {
        tensors[m].resize(counts[m]);
        for (uint64_t i = 0; i < counts[m]; ++i) tensors[m][i] = (uint64_t{m} << 32) | i;
        layout.copy_in(m, tensors[m].data(), buffer.data(), sizeof(uint64_t));
      }
      layout.zero_padding(buffer.data(), sizeof(uint64_t));
      uint64_t placed = 0;
      for (uint64_t p = 0; p < buffer.size(); ++p) {
        const int chunk = static_cast<int>(p / layout.chunk_elements());
        if (buffer[p] == 0 && !(p % layout.chunk_elements() == 0 && counts[0] > 0)) {
          // Padding (or element 0 of member 0, which is 0 too: counts[0] is 0 here).
          continue;
        }
        const size_t member = buffer[p] >> 32;
        const uint64_t index = buffer[p] & 0xffffffffu;
        INFO("position " << p << " holds member " << member << " element " << index);
        REQUIRE(member < counts.size());
        CHECK(index >= chunk_begin(counts[member], ranks, chunk));
        CHECK(index <
              chunk_begin(counts[member], ranks, chunk) + chunk_size(counts[member], ranks, chunk));
        ++placed;
      }
      CHECK(placed == std::accumulate(counts.begin(), counts.end(), uint64_t{0}));
      for (size_t m = 0; m < counts.size(); ++m) {
        std::vector<uint64_t> back(counts[m], 0);
        layout.copy_out(m, buffer.data(), back.data(), sizeof(uint64_t));
        CHECK(back == tensors[m]);
      }
    }
  }
}

TEST_CASE("negotiation messages round-trip and malformed ones are refused", "[fusion_units]") {
  RequestList requests = with_bits({0, 5, 70});
  UnitSpec group = allreduce("g.a", 3, DataType::kBFloat16, ReduceOp::kAvg);
  group.members.push_back({"g.b", 0});
  group.prescale = 0.5;
  requests.announcements = {allreduce("x", 10), group};
  UnitSpec broadcast;
  broadcast.kind = Kind::kBroadcast;
  broadcast.root = 2;
  broadcast.members.push_back({"w", 99});
  requests.announcements.push_back(broadcast);
  std::vector<uint8_t> bytes;
  encode(requests, bytes);
  RequestList decoded = decode_requests(bytes.data(), bytes.size(), 3, 128);
  CHECK(decoded.ready_words == requests.ready_words);
  CHECK(decoded.announcements == requests.announcements);

  ResponseList response;
  response.idle = true;
  response.all_joined = 2;
  response.errors.push_back({"bad", Status::kMismatch, "ranks disagree about tensor 'bad'"});
  Batch batch;
  batch.fused = true;
  batch.units.push_back({true, 5, {}});
  batch.units.push_back({false, -1, allreduce("y", 4)});
  response.batches.push_back(batch);
  encode(response, bytes);
  ResponseCache cache(128);
  cache.store(5, allreduce("z", 2));  // the hit's unit, fusable with y
  ResponseList back = decode_responses(bytes.data(), bytes.size(), 3, cache);
  CHECK(back.idle);
  CHECK(back.all_joined == 2);
  {  // the last rank to join must be a rank of the job (or -1: not every rank has joined)
    ResponseList outside = response;
    outside.all_joined = 3;
    std::vector<uint8_t> encoded;
    encode(outside, encoded);
    ResponseCache with_z(128);
    with_z.store(5, allreduce("z", 2));
    CHECK_THROWS_AS(decode_responses(encoded.data(), encoded.size(), 3, with_z), Error);
  }
  REQUIRE(back.errors.size() == 1);
  CHECK(back.errors[0].message == response.errors[0].message);
  CHECK(back.errors[0].status == Status::kMismatch);
  REQUIRE(back.batches.size() == 1);
  CHECK(back.batches[0].fused);
  CHECK(back.batches[0].units[0].hit);
  CHECK(back.batches[0].units[0].slot == 5);
  CHECK(back.batches[0].units[1].spec == allreduce("y", 4));

  auto refused = [](const std::vector<uint8_t>& data, bool is_request, uint32_t capacity = 128) {
    try {
      if (is_request) {
        decode_requests(data.data(), data.size(), 3, capacity);
      } else {
        ResponseCache cache(capacity);
        if (capacity > 5) cache.store(5, allreduce("z", 2));
        decode_responses(data.data(), data.size(), 3, cache);
      }
    } catch (const Error& error) {
      CHECK(error.status() == Status::kInternal);
      CHECK(std::string(error.what()).find("malformed") != std::string::npos);
      return true;
    }
    return false;
  };
  encode(requests, bytes);
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    INFO("truncated to " << cut);
    CHECK(refused(std::vector<uint8_t>(bytes.begin(), bytes.begin() + cut), true));
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  CHECK(refused(longer, true));
  CHECK(refused(bytes, true, 64));  // bit 70 beyond a cache of 64
  // An error whose status is no kolo_status_t (nor success) is refused, not handed to a caller.
  for (int status : {0, -1, 10, 64}) {
    ResponseList odd;
    odd.errors.push_back({"t", static_cast<Status>(status), "m"});
    encode(odd, bytes);
    INFO("status " << status);
    CHECK(refused(bytes, false));
  }
  // A name length far beyond what is left, and beyond kMaxNameBytes.
  RequestList one = announcing({allreduce(std::string(kMaxNameBytes, 'n'), 1)});
  encode(one, bytes);
  CHECK_FALSE(refused(bytes, true));
  one.announcements[0].members[0].name += "n";
  encode(one, bytes);
  CHECK(refused(bytes, true));
  // An unknown dtype, a root outside the communicator.
  one = announcing({allreduce("x", 1)});
  encode(one, bytes);
  std::vector<uint8_t> bad_dtype = bytes;
  bad_dtype[4 + 4 + 1] = 99;  // word count, announcement count, kind, then the dtype
  CHECK(refused(bad_dtype, true));
  one = announcing({broadcast});
  one.announcements[0].root = 3;
  encode(one, bytes);
  CHECK(refused(bytes, true));
  // A response naming a slot beyond the cache.
  encode(response, bytes);
  CHECK(refused(bytes, false, 4));
}

TEST_CASE("the response cache stores, finds and replaces", "[fusion_units]") {
  ResponseCache cache(3);
  CHECK(cache.free_slot() == 0);
  cache.store(0, allreduce("a", 1));
  cache.store(1, allreduce("b", 1));
  CHECK(cache.find(allreduce("a", 1)) == 0);
  CHECK(cache.find(allreduce("a", 2)) == -1);  // another spec
  CHECK(cache.slot_of("a") == 0);
  CHECK(cache.free_slot() == 2);
  cache.store(0, allreduce("c", 1));  // evicts a
  CHECK(cache.slot_of("a") == -1);
  CHECK(cache.slot_of("c") == 0);
  cache.store(2, allreduce("c", 5));  // c moves: slot 0 empties
  CHECK(cache.slot_of("c") == 2);
  CHECK(cache.at(0) == nullptr);
  CHECK(cache.free_slot() == 0);
  CHECK(cache.size() == 2);
}

TEST_CASE("the coordinator: readiness, agreement, cache slots and batches", "[fusion_units]") {
  ResponseCache cache(4);
  Coordinator coordinator({3, 0.0, 0.0}, cache);
  uint64_t cycle = 0;
  auto process = [&](std::vector<RequestList> lists, uint64_t threshold = 1 << 20,
                     Clock::time_point now = at(0)) {
    ResponseList response = coordinator.process(++cycle, lists, threshold, now);
    apply(cache, response);
    return response;
  };

  SECTION("a tensor is ready once every rank has submitted it, then cached") {
    ResponseList response = process({announcing({allreduce("a", 10)}), {}, {}});
    CHECK(response.batches.empty());
    CHECK_FALSE(response.idle);
    CHECK(coordinator.outstanding() == 1);
    response = process({{}, announcing({allreduce("a", 10)}), announcing({allreduce("a", 10)})});
    REQUIRE(response.batches.size() == 1);
    CHECK_FALSE(response.batches[0].units[0].hit);
    CHECK(response.batches[0].units[0].slot == 0);
    CHECK(response.idle);
    CHECK(cache.find(allreduce("a", 10)) == 0);
    // Next time: a bit from every rank is a hit.
    response = process({with_bits({0}), with_bits({0}), with_bits({0})});
    REQUIRE(response.batches.size() == 1);
    CHECK(response.batches[0].units[0].hit);
    CHECK(response.batches[0].units[0].slot == 0);
    // Bits from some ranks only: waits, then a hit when the last one comes.
    response = process({with_bits({0}), {}, with_bits({0})});
    CHECK(response.batches.empty());
    CHECK_FALSE(response.idle);
    response = process({with_bits({0}), with_bits({0}), with_bits({0})});
    REQUIRE(response.batches.size() == 1);
    CHECK(response.batches[0].units[0].hit);
    CHECK(response.idle);
  }

  SECTION("a slot is given to one unit per response, even when a key's old slot was evicted") {
    // Fill the 4 slots, then in one cycle a new tensor evicts the least recently used slot,
    // which is 'b''s, and 'b' comes back with another spec: it must not take that slot too.
    std::vector<UnitSpec> four = {allreduce("a", 1), allreduce("b", 2), allreduce("c", 3),
                                  allreduce("d", 4)};
    process({announcing(four), announcing(four), announcing(four)});
    REQUIRE(cache.find(allreduce("b", 2)) >= 0);
    process({with_bits({0, 2, 3}), with_bits({0, 2, 3}), with_bits({0, 2, 3})});  // b is LRU
    const std::vector<UnitSpec> next = {allreduce("x", 5), allreduce("b", 6)};
    ResponseList response = process({announcing(next), announcing(next), announcing(next)});
    std::vector<int32_t> slots;
    for (const Batch& batch : response.batches) {
      for (const ResponseUnit& unit : batch.units) {
        if (unit.slot >= 0) slots.push_back(unit.slot);
      }
    }
    std::sort(slots.begin(), slots.end());
    CHECK(std::adjacent_find(slots.begin(), slots.end()) == slots.end());
    std::vector<uint8_t> bytes;
    encode(response, bytes);
    ResponseCache before(4);
    for (uint32_t s = 0; s < 4; ++s) before.store(s, four[s]);
    CHECK_NOTHROW(decode_responses(bytes.data(), bytes.size(), 3, before));
  }

  SECTION("ranks that disagree: an error naming the tensor, the ranks and both specs") {
    ResponseList response =
        process({announcing({allreduce("b", 10)}), announcing({allreduce("b", 10)}),
                 announcing({allreduce("b", 9)})});
    CHECK(response.batches.empty());
    REQUIRE(response.errors.size() == 1);
    CHECK(response.errors[0].key == "b");
    CHECK(response.errors[0].status == Status::kMismatch);
    CHECK(response.errors[0].message ==
          "ranks disagree about tensor 'b': ranks 0, 1 submitted allreduce 'b' (count 10, "
          "float32, sum) but rank 2 submitted allreduce 'b' (count 9, float32, sum)");
    CHECK(coordinator.outstanding() == 0);
  }

  SECTION("a cached tensor submitted with another spec by one rank is a mismatch") {
    process({announcing({allreduce("a", 10)}), announcing({allreduce("a", 10)}),
             announcing({allreduce("a", 10)})});
    ResponseList response =
        process({with_bits({0}), with_bits({0}), announcing({allreduce("a", 11)})});
    REQUIRE(response.errors.size() == 1);
    CHECK(response.errors[0].message.find("rank 2 submitted allreduce 'a' (count 11") !=
          std::string::npos);
  }

  SECTION("a tensor whose spec changes on every rank keeps its slot") {
    process({announcing({allreduce("a", 10)}), announcing({allreduce("a", 10)}),
             announcing({allreduce("a", 10)})});
    ResponseList response =
        process({announcing({allreduce("a", 20)}), announcing({allreduce("a", 20)}),
                 announcing({allreduce("a", 20)})});
    REQUIRE(response.batches.size() == 1);
    CHECK(response.batches[0].units[0].slot == 0);
    CHECK(cache.find(allreduce("a", 20)) == 0);
  }

  SECTION("eviction takes the least recently used slot nobody is waiting on") {
    for (const char* name : {"a", "b", "c", "d"}) {
      process({announcing({allreduce(name, 1)}), announcing({allreduce(name, 1)}),
               announcing({allreduce(name, 1)})});
    }
    REQUIRE(cache.size() == 4);
    // a (slot 0) is the oldest, but rank 1 is waiting on it: b (slot 1) goes.
    RequestList waiting_on_a = with_bits({0});
    waiting_on_a.announcements = {allreduce("e", 1)};
    ResponseList response =
        process({announcing({allreduce("e", 1)}), waiting_on_a, announcing({allreduce("e", 1)})});
    REQUIRE(response.batches.size() == 1);
    CHECK(response.batches[0].units[0].slot == 1);
    CHECK(cache.slot_of("b") == -1);
    CHECK(cache.slot_of("a") == 0);
    // Every slot busy: the new tensor is not cached.
    RequestList all_busy = with_bits({0, 1, 2, 3});
    RequestList everything = all_busy;
    everything.announcements = {allreduce("f", 1)};
    response = process({everything, all_busy, all_busy});
    bool found_f = false;
    for (const Batch& batch : response.batches) {
      for (const ResponseUnit& unit : batch.units) {
        if (!unit.hit && unit.spec.key() == "f") {
          found_f = true;
          CHECK(unit.slot == -1);
        }
      }
    }
    CHECK_FALSE(found_f);  // rank 1 and 2 have not announced f: not ready, nothing to cache
    response = process({with_bits({0, 1, 2, 3}), everything, everything});
    for (const Batch& batch : response.batches) {
      for (const ResponseUnit& unit : batch.units) {
        if (!unit.hit && unit.spec.key() == "f") {
          found_f = true;
          CHECK(unit.slot == -1);
        }
      }
    }
    CHECK(found_f);
  }

  SECTION("eviction follows use, not slot numbers") {
    for (const char* name : {"a", "b", "c", "d"}) {  // slots 0-3, a used first
      process({announcing({allreduce(name, 1)}), announcing({allreduce(name, 1)}),
               announcing({allreduce(name, 1)})});
    }
    auto use = [&](std::vector<uint32_t> slots) {
      process({with_bits(slots), with_bits(slots), with_bits(slots)});
    };
    auto newcomer = [&](const char* name) {
      const std::vector<UnitSpec> spec = {allreduce(name, 1)};
      ResponseList response = process({announcing(spec), announcing(spec), announcing(spec)});
      REQUIRE(response.batches.size() == 1);
      return response.batches[0].units[0].slot;
    };
    use({0});                   // a, the oldest, becomes the newest: b, c, d, a
    use({2});                   // c from the middle: b, d, a, c
    use({2});                   // c again, already the newest
    CHECK(newcomer("e") == 1);  // b goes; e in slot 1: d, a, c, e
    CHECK(cache.slot_of("b") == -1);
    use({1, 3});                // e and d: a, c, then e and d (used in the same cycle)
    CHECK(newcomer("f") == 0);  // a goes
    CHECK(newcomer("g") == 2);  // then c
    CHECK(cache.slot_of("d") == 3);
    CHECK(cache.slot_of("e") == 1);
  }

  SECTION("a bit for an empty slot is an error") {
    CHECK_THROWS_AS(process({with_bits({3}), {}, {}}), Error);
  }
}

TEST_CASE("batches: same dtype, op and factors, within the threshold, looking past misfits",
          "[fusion_units]") {
  ResponseCache cache(0);
  Coordinator coordinator({1, 0.0, 0.0}, cache);
  UnitSpec maxed = allreduce("max", 10, DataType::kFloat32, ReduceOp::kMax);
  UnitSpec doubles = allreduce("f64", 10, DataType::kFloat64);
  UnitSpec scaled = allreduce("scaled", 10);
  scaled.prescale = 0.5;
  UnitSpec broadcast;
  broadcast.kind = Kind::kBroadcast;
  broadcast.root = 0;
  broadcast.members.push_back({"bcast", 10});
  UnitSpec group = allreduce("g.0", 100);
  group.members.push_back({"g.1", 100});

  ResponseList response =
      coordinator.process(1,
                          {announcing({allreduce("big", 60), maxed, allreduce("mid", 50), doubles,
                                       broadcast, scaled, allreduce("small", 30)})},
                          400, at(0));
  std::vector<std::vector<std::string>> batches;
  for (const Batch& batch : response.batches) {
    std::vector<std::string> keys;
    for (const ResponseUnit& unit : batch.units) keys.push_back(unit.spec.key());
    batches.push_back(keys);
  }
  // In the order announced, each batch taking what fits after it: 60 + 50 floats exceed 400
  // bytes, 60 + 30 do not.
  const std::vector<std::vector<std::string>> expected = {{"big", "small"}, {"max"},   {"mid"},
                                                          {"f64"},          {"bcast"}, {"scaled"}};
  CHECK(batches == expected);
  for (const Batch& batch : response.batches) CHECK(batch.fused == (batch.units.size() > 1));

  SECTION("threshold 0: nothing fused, a group runs member by member") {
    response = coordinator.process(2, {announcing({allreduce("a", 1), allreduce("b", 1), group})},
                                   0, at(0));
    CHECK(response.batches.size() == 3);
    for (const Batch& batch : response.batches) CHECK_FALSE(batch.fused);
  }
  SECTION("a tensor of a megabyte or more runs alone, in place, whatever the threshold") {
    response =
        coordinator.process(2,
                            {announcing({allreduce("small", 10), allreduce("huge", kAloneBytes / 4),
                                         allreduce("small2", 10)})},
                            64 << 20, at(0));
    REQUIRE(response.batches.size() == 2);
    CHECK(response.batches[0].units.size() == 2);
    CHECK(response.batches[0].fused);
    CHECK(response.batches[1].units[0].spec.key() == "huge");
    CHECK_FALSE(response.batches[1].fused);
  }
  SECTION("below a megabyte where rank 0 measured that fusing does not pay") {
    coordinator.set_alone_bytes(4000);
    response = coordinator.process(
        2, {announcing({allreduce("tiny", 10), allreduce("mid", 1000), allreduce("tiny2", 10)})},
        64 << 20, at(0));
    REQUIRE(response.batches.size() == 2);
    CHECK(response.batches[0].units.size() == 2);
    CHECK(response.batches[0].fused);
    CHECK(response.batches[1].units[0].spec.key() == "mid");
    CHECK_FALSE(response.batches[1].fused);
    coordinator.set_alone_bytes(kAloneBytes * 4);  // never above a megabyte
    CHECK(coordinator.alone_bytes() == kAloneBytes);
  }
  SECTION("tensors too large to fuse share one ring, by kind, within the threshold") {
    const uint64_t floats = kAloneBytes / 4;
    response = coordinator.process(
        2,
        {announcing({allreduce("h1", floats), allreduce("small", 10),
                     allreduce("h64", floats / 2, DataType::kFloat64), allreduce("h2", floats),
                     allreduce("h3", floats), allreduce("h64b", floats / 2, DataType::kFloat64)})},
        2 * kAloneBytes + 1, at(0));
    batches.clear();
    for (const Batch& batch : response.batches) {
      std::vector<std::string> keys;
      for (const ResponseUnit& unit : batch.units) keys.push_back(unit.spec.key());
      batches.push_back(keys);
      CHECK_FALSE(batch.fused);
      CHECK(batch.one_ring == (keys.size() > 1));
    }
    // h3 would take h1's batch past the threshold; the float64 tensors are of another kind.
    const std::vector<std::vector<std::string>> shared = {
        {"h1", "h2"}, {"small"}, {"h64", "h64b"}, {"h3"}};
    CHECK(batches == shared);
    response = coordinator.process(
        3, {announcing({allreduce("z1", floats), allreduce("z2", floats)})}, 0, at(0));
    REQUIRE(response.batches.size() == 2);
    for (const Batch& batch : response.batches) CHECK_FALSE(batch.one_ring);
    // Nor where rank 0's ring neighbours are reached through shared memory.
    ResponseCache no_cache(0);
    Coordinator through_memory({1, 0.0, 0.0, false}, no_cache);
    response = through_memory.process(
        1, {announcing({allreduce("m1", floats), allreduce("m2", floats)})}, 64 << 20, at(0));
    REQUIRE(response.batches.size() == 2);
    for (const Batch& batch : response.batches) CHECK_FALSE(batch.one_ring);
  }
  SECTION("a group larger than the threshold still runs as one fused collective") {
    response = coordinator.process(2, {announcing({group})}, 100, at(0));
    REQUIRE(response.batches.size() == 1);
    CHECK(response.batches[0].fused);
    CHECK(response.batches[0].units.size() == 1);
  }
}

TEST_CASE("the alone size is a collective's latency over the cost of copying a byte",
          "[fusion_units]") {
  using std::chrono::microseconds;
  using std::chrono::nanoseconds;
  FusionCost cost;
  CHECK(cost.alone_bytes() == kAloneBytes);  // nothing measured: as before the measuring
  for (int i = 0; i < 5; ++i) cost.alone(4, microseconds(3));
  CHECK(cost.latency_s() == Approx(3e-6));
  CHECK(cost.alone_bytes() == kAloneBytes);  // no copy measured yet
  // One or two copies measured are not yet the machine's speed: one preempted copy loop must not
  // send tensors alone.
  cost.copied(1000000, 10, nanoseconds(30000000));  // 30 ns per byte
  CHECK(cost.alone_bytes() == kAloneBytes);
  for (size_t i = 1; i < FusionCost::kMinCopySamples; ++i) {
    CHECK(cost.alone_bytes() == kAloneBytes);
    cost.copied(1000000, 10, nanoseconds(300000));  // 0.3 ns per byte
  }
  CHECK(cost.copy_s_per_byte() == Approx(0.3e-9));
  CHECK(cost.alone_bytes() == 10000);  // 3 us / 0.3 ns
  // Larger collectives are not latencies; small copies, and copies of many tiny tensors (whose
  // time is the copy loop's per tensor), are not a byte's cost: all ignored.
  cost.alone(FusionCost::kLatencyBytes + 1, microseconds(1000));
  cost.copied(FusionCost::kCopyBytes - 1, 1, microseconds(1000));
  const uint64_t tiny = FusionCost::kCopyTensorBytes - 1;
  for (size_t i = 0; i < FusionCost::kSamples; ++i) {
    cost.copied(400 * tiny, 400, microseconds(1000));
  }
  CHECK(cost.alone_bytes() == 10000);
  // Medians of the last kSamples: one slow collective does not move it, a slower machine does.
  cost.alone(4, microseconds(500));
  CHECK(cost.alone_bytes() == 10000);
  for (size_t i = 0; i < FusionCost::kSamples; ++i) cost.alone(4, microseconds(6));
  CHECK(cost.alone_bytes() == 20000);
  // A network's latency makes every tensor below a megabyte worth fusing, never more.
  for (size_t i = 0; i < FusionCost::kSamples; ++i) cost.alone(4, microseconds(50000));
  CHECK(cost.alone_bytes() == kAloneBytes);
}

TEST_CASE("the first collective of a response is not a latency sample", "[fusion_units]") {
  using std::chrono::microseconds;
  FusionCost cost;
  for (int i = 0; i < 5; ++i) cost.alone(4, microseconds(2));  // the probe when connecting
  CHECK(cost.latency_s() == Approx(2e-6));
  // A training loop whose responses start with a small tensor alone, which waits for the ranks
  // that read the response later: those waits are no collective's latency.
  for (size_t i = 0; i < 2 * FusionCost::kSamples; ++i) {
    cost.start_response();
    cost.alone(4, microseconds(150));
    cost.alone(8 << 20, microseconds(2000));  // too large to be a latency anyway
  }
  CHECK(cost.latency_s() == Approx(2e-6));
  // Later in a response an allreduce alone is a sample, after any kind of collective.
  for (size_t i = 0; i < FusionCost::kSamples; ++i) {
    cost.start_response();
    cost.ran();  // a fused batch, a broadcast or an allgather
    cost.alone(4, microseconds(5));
  }
  CHECK(cost.latency_s() == Approx(5e-6));
  for (size_t i = 0; i < FusionCost::kSamples; ++i) {
    cost.start_response();
    cost.alone(4, microseconds(300));
    cost.alone(4, microseconds(7));
  }
  CHECK(cost.latency_s() == Approx(7e-6));
}

TEST_CASE("recursive-doubling and ring tensors are fused apart, the former in small batches",
          "[fusion_units]") {
  ResponseCache cache(0);
  Coordinator coordinator({2, 0.0, 0.0}, cache);
  // At N = 2 recursive doubling runs up to 64 KiB: 16384 floats.
  REQUIRE(engine_algorithm(allreduce("x", 16384), 2) == Algorithm::kRecursiveDoubling);
  REQUIRE(engine_algorithm(allreduce("x", 16386), 2) == Algorithm::kRing);
  auto keys = [](const ResponseList& response) {
    std::vector<std::vector<std::string>> batches;
    for (const Batch& batch : response.batches) {
      std::vector<std::string> names;
      for (const ResponseUnit& unit : batch.units) names.push_back(unit.spec.key());
      batches.push_back(names);
    }
    return batches;
  };
  const std::vector<UnitSpec> mixed = {allreduce("a", 10), allreduce("big", 20000),
                                       allreduce("b", 10), allreduce("big2", 20000)};
  ResponseList response =
      coordinator.process(1, {announcing(mixed), announcing(mixed)}, 64 << 20, at(0));
  CHECK(keys(response) == std::vector<std::vector<std::string>>{{"a", "b"}, {"big", "big2"}});
  // Five of 60000 bytes: at most latency_batch_bytes(2) = 256 KiB together, so four and one.
  REQUIRE(latency_batch_bytes(2) == 256 * 1024);
  std::vector<UnitSpec> five;
  for (const char* name : {"s0", "s1", "s2", "s3", "s4"}) five.push_back(allreduce(name, 15000));
  response = coordinator.process(2, {announcing(five), announcing(five)}, 64 << 20, at(0));
  CHECK(keys(response) == std::vector<std::vector<std::string>>{{"s0", "s1", "s2", "s3"}, {"s4"}});
}

TEST_CASE("stalled tensors are aborted after KOLO_STALL_ABORT_S, naming the missing ranks",
          "[fusion_units]") {
  ResponseCache cache(8);
  Coordinator coordinator({4, 0.5, 2.0}, cache);
  ResponseList response = coordinator.process(
      1, {announcing({allreduce("x", 1)}), announcing({allreduce("x", 1)}), {}, {}}, 1 << 20,
      at(0));
  CHECK(response.errors.empty());
  response = coordinator.process(2, {{}, {}, {}, {}}, 1 << 20, at(1));  // warns (on stderr)
  CHECK(response.errors.empty());
  response = coordinator.process(3, {{}, {}, {}, {}}, 1 << 20, at(2.5));
  REQUIRE(response.errors.size() == 1);
  CHECK(response.errors[0].status == Status::kTimeout);
  CHECK(response.errors[0].message ==
        "tensor 'x' stalled: submitted by ranks 0, 1 but not by ranks 2, 3 within 2 s "
        "(KOLO_STALL_ABORT_S)");
  CHECK(response.idle);
}

TEST_CASE("rank lists are compact", "[fusion_units]") {
  CHECK(format_ranks({2}) == "rank 2");
  CHECK(format_ranks({0, 1, 5}) == "ranks 0, 1, 5");
  CHECK(format_ranks({0, 1, 2, 5, 6, 7, 9}) == "ranks 0-2, 5-7, 9");
  std::vector<int> many(64);
  std::iota(many.begin(), many.end(), 0);
  CHECK(format_ranks(many) == "ranks 0-63");
}

TEST_CASE("specs are checked", "[fusion_units]") {
  CHECK(check_spec(allreduce("a", 1), 2).empty());
  CHECK(check_spec(allreduce("", 1), 2).find("empty") != std::string::npos);
  CHECK(check_spec(allreduce(std::string(1025, 'x'), 1), 2).find("1024") != std::string::npos);
  UnitSpec twice = allreduce("a", 1);
  twice.members.push_back({"a", 2});
  CHECK(check_spec(twice, 2).find("twice") != std::string::npos);
  UnitSpec huge = allreduce("a", ~uint64_t{0} / 2);
  CHECK(check_spec(huge, 2).find("too large") != std::string::npos);
  UnitSpec nan = allreduce("a", 1);
  nan.postscale = std::nan("");
  CHECK(check_spec(nan, 2).find("finite") != std::string::npos);
  CHECK(describe(allreduce("conv1.weight", 9408, DataType::kFloat32, ReduceOp::kAvg)) ==
        "allreduce 'conv1.weight' (count 9408, float32, avg)");
}

TEST_CASE("the timeline is valid JSON, one file per rank", "[fusion_units]") {
  CHECK(Timeline::path_for_rank("/tmp/trace.json", 3) == "/tmp/trace.rank3.json");
  CHECK(Timeline::path_for_rank("/tmp/trace", 0) == "/tmp/trace.rank0.json");
  CHECK(Timeline::escape("a\"b\\c\n\x01") == "a\\\"b\\\\c\\n\\u0001");
  auto path = std::filesystem::temp_directory_path() /
              ("kolo_timeline_unit_" + std::to_string(::getpid()) + ".json");
  {
    Timeline timeline(path.string(), 2);
    uint32_t row = timeline.row("weird \"name\"\\");
    CHECK(timeline.row("weird \"name\"\\") == row);
    for (int i = 0; i < 20000; ++i) {  // more than one batch of the writer
      timeline.span(row, "ALLREDUCE", at(i * 1e-6), at(i * 1e-6 + 5e-7), "{\"i\":1}");
    }
    timeline.instant(row, "ERROR", at(1));
  }
  std::ifstream file(path);
  nlohmann::json trace = nlohmann::json::parse(file);
  REQUIRE(trace.is_array());
  size_t spans = 0;
  bool named = false;
  for (const auto& event : trace) {
    CHECK(event.at("pid") == 2);
    if (event.at("name") == "ALLREDUCE") {
      ++spans;
      CHECK(event.at("dur").get<double>() == Approx(0.5).margin(0.002));
    }
    if (event.at("name") == "thread_name" && event.at("args").at("name") == "weird \"name\"\\") {
      named = true;
    }
  }
  CHECK(spans == 20000);
  CHECK(named);
  std::filesystem::remove(path);
}

// Named allgathers: each rank announces its own count and capacity, rank 0 answers with every
// rank's count; such units are never cached or fused, and what a peer sends is bounded.
TEST_CASE("allgather units: wire format, matching and the coordinator", "[fusion_units]") {
  // Round trip of an announcement.
  RequestList requests;
  requests.announcements = {gather("g", 5, 100)};
  std::vector<uint8_t> bytes;
  encode(requests, bytes);
  CHECK(bytes.size() == 4 + 4 + encoded_size(requests.announcements[0]) + 1);  // + joined flag
  RequestList back = decode_requests(bytes.data(), bytes.size(), 3, 64);
  CHECK(back.announcements == requests.announcements);
  CHECK_FALSE(back.joined);
  {  // kolo_join's flag travels, and nothing but 0 or 1 is accepted for it
    RequestList joined = requests;
    joined.joined = true;
    std::vector<uint8_t> flagged;
    encode(joined, flagged);
    CHECK(decode_requests(flagged.data(), flagged.size(), 3, 64).joined);
    flagged.back() = 2;
    CHECK(refused_requests(flagged, 3));
  }
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    CHECK(refused_requests(std::vector<uint8_t>(bytes.begin(), bytes.begin() + cut), 3));
  }
  // An announcement that carries gathered counts is malformed.
  UnitSpec with_counts = gather("g", 0, 0);
  with_counts.gather_counts = {1, 2, 3};
  requests.announcements = {with_counts};
  encode(requests, bytes);
  CHECK(refused_requests(bytes, 3));
  // Huge capacity.
  requests.announcements = {gather("g", 5, ~uint64_t{0})};
  encode(requests, bytes);
  CHECK(refused_requests(bytes, 3));
  // Two members.
  UnitSpec two = gather("g", 5, 10);
  two.members.push_back({"h", 1});
  requests.announcements = {two};
  encode(requests, bytes);
  CHECK(refused_requests(bytes, 3));

  // Responses.
  ResponseList response;
  Batch batch;
  ResponseUnit unit;
  unit.spec = with_counts;
  batch.units.push_back(unit);
  response.batches.push_back(batch);
  encode(response, bytes);
  ResponseList decoded = decode_responses(bytes.data(), bytes.size(), 3, ResponseCache(64));
  CHECK(decoded.batches.at(0).units.at(0).spec == with_counts);
  CHECK(refused_responses(bytes, 4));  // 3 counts for 4 ranks
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    CHECK(refused_responses(std::vector<uint8_t>(bytes.begin(), bytes.begin() + cut), 3));
  }
  // A cached or fused allgather, or one without counts, is malformed.
  response.batches[0].units[0].slot = 3;
  encode(response, bytes);
  CHECK(refused_responses(bytes, 3));
  response.batches[0].units[0].slot = -1;
  response.batches[0].fused = true;
  encode(response, bytes);
  CHECK(refused_responses(bytes, 3));
  response.batches[0].fused = false;
  response.batches[0].units[0].spec.gather_counts.clear();
  encode(response, bytes);
  CHECK(refused_responses(bytes, 3));
  // Counts whose sum overflows.
  response.batches[0].units[0].spec.gather_counts = {~uint64_t{0} / 8, ~uint64_t{0} / 8, 1};
  encode(response, bytes);
  CHECK(refused_responses(bytes, 3));
  // A gathered-count length field far beyond the ranks.
  response.batches[0].units[0].spec.gather_counts = {1, 2, 3};
  encode(response, bytes);
  bytes[bytes.size() - 3 * 8 - 4] = 200;
  CHECK(refused_responses(bytes, 3));

  // Matching a scheduled spec against a submission.
  UnitSpec scheduled = with_counts;  // counts 1, 2, 3: total 6
  CHECK(matches_submission(gather("g", 2, 6), scheduled, 1));
  CHECK(!matches_submission(gather("g", 2, 5), scheduled, 1));   // capacity
  CHECK(!matches_submission(gather("g", 3, 6), scheduled, 1));   // count
  CHECK(!matches_submission(gather("g", 2, 6, DataType::kInt32), scheduled, 1));
  CHECK(!matches_submission(gather("g", 2, 6), scheduled, 3));   // no such rank

  // Coordinator: counts gathered, never cached, capacity errors on every rank.
  ResponseCache cache(8);
  Coordinator coordinator(CoordinatorSettings{3, 0, 0}, cache);
  std::vector<RequestList> lists(3);
  for (int r = 0; r < 3; ++r) lists[r].announcements = {gather("g", uint64_t(r) * 2, 100)};
  ResponseList out = coordinator.process(1, lists, 1 << 20, Clock::now());
  CHECK(out.errors.empty());
  CHECK(out.batches.size() == 1);
  CHECK(out.batches[0].units[0].slot == -1);
  CHECK(!out.batches[0].fused);
  CHECK((out.batches[0].units[0].spec.gather_counts == std::vector<uint64_t>{0, 2, 4}));
  CHECK(out.batches[0].units[0].spec.members[0].count == 0);
  CHECK(coordinator.outstanding() == 0);
  for (int r = 0; r < 3; ++r) lists[r].announcements = {gather("g", 10, r == 1 ? 29 : 30)};
  out = coordinator.process(2, lists, 1 << 20, Clock::now());
  CHECK(out.batches.empty());
  CHECK(out.errors.size() == 1);
  CHECK(out.errors[0].status == Status::kInvalidArgument);
  CHECK(out.errors[0].message.find("29") != std::string::npos);
  // Counts whose sum overflows: an error on every rank, not a crash.
  for (int r = 0; r < 3; ++r) {
    lists[r].announcements = {gather("big", ~uint64_t{0} / 4, ~uint64_t{0} / 4, DataType::kUInt8)};
  }
  out = coordinator.process(3, lists, 1 << 20, Clock::now());
  CHECK(out.errors.size() == 1);
  // Allgathers among allreduces: never fused with them.
  UnitSpec reduce;
  reduce.members.push_back({"r", 10});
  UnitSpec reduce2 = reduce;
  reduce2.members[0].name = "r2";
  for (int r = 0; r < 3; ++r) lists[r].announcements = {reduce, gather("g", 1, 3), reduce2};
  out = coordinator.process(4, lists, 1 << 20, Clock::now());
  CHECK(out.batches.size() == 2);
  CHECK(out.batches[0].fused);
  CHECK(out.batches[0].units.size() == 2);
  CHECK(out.batches[1].units[0].spec.kind == Kind::kAllgather);
  }

// Rank 0 decides what is fused, but a member acts on what it decodes: a fused batch whose units
// cannot share one collective would be copied with the first unit's element size for every
// member, past the end of a larger-element buffer. The decoder refuses every such response.
TEST_CASE("a response that fuses what cannot be fused is refused before anything runs",
          "[fusion_units]") {
  ResponseCache cache(8);
  cache.store(0, allreduce("cached64", 100, DataType::kFloat64));
  auto unit = [](const UnitSpec& spec) { return ResponseUnit{false, -1, spec}; };
  auto hit = [](int32_t slot) { return ResponseUnit{true, slot, {}}; };
  UnitSpec broadcast;
  broadcast.kind = Kind::kBroadcast;
  broadcast.root = 1;
  broadcast.members.push_back({"w", 99});
  auto outcome = [&](bool fused, std::vector<ResponseUnit> units,
                     bool one_ring = false) -> std::string {
    ResponseList response;
    response.batches.push_back({fused, std::move(units), one_ring});
    std::vector<uint8_t> bytes;
    encode(response, bytes);
    try {
      decode_responses(bytes.data(), bytes.size(), 3, cache);
    } catch (const Error& error) {
      CHECK(error.status() == Status::kInternal);
      return error.what();
    }
    return "accepted";
  };
  const UnitSpec a32 = allreduce("a", 10), b64 = allreduce("b", 10, DataType::kFloat64);
  CHECK_THAT(outcome(true, {unit(a32), unit(b64)}),
             Catch::Contains("malformed") && Catch::Contains("a fused batch of"));
  CHECK_THAT(outcome(true, {unit(a32), hit(0)}), Catch::Contains("a fused batch of"));
  CHECK_THAT(outcome(true, {hit(0), unit(a32)}), Catch::Contains("a fused batch of"));
  CHECK_THAT(outcome(true, {unit(a32), unit(allreduce("m", 10, DataType::kFloat32,
                                                      ReduceOp::kMax))}),
             Catch::Contains("a fused batch of"));
  CHECK_THAT(outcome(true, {unit(broadcast)}), Catch::Contains("a fused batch of"));
  CHECK_THAT(outcome(true, {unit(a32), unit(broadcast)}), Catch::Contains("a fused batch of"));
  // At N = 3 a float32 tensor of 100000 elements is reduced by the ring, one of 10 by recursive
  // doubling: the executor could not run both in one collective.
  CHECK_THAT(outcome(true, {unit(a32), unit(allreduce("ring", 100000))}),
             Catch::Contains("a fused batch of"));
  CHECK_THAT(outcome(false, {hit(3)}), Catch::Contains("cache slot 3, which is empty"));
  CHECK_THAT(outcome(false, {hit(0), unit(a32)}), Catch::Contains("accepted"));
  ResponseUnit cached_a32 = unit(a32);
  cached_a32.slot = 0;
  CHECK_THAT(outcome(false, {hit(0), cached_a32}), Catch::Contains("cache slot 0 twice"));
  // What the coordinator fuses decodes.
  CHECK_THAT(outcome(true, {unit(a32), unit(allreduce("c", 3))}), Catch::Contains("accepted"));
  CHECK_THAT(outcome(true, {hit(0), unit(b64)}), Catch::Contains("accepted"));
  // A batch on one ring: allreduces that fusable() accepts together, each reduced by the ring.
  const UnitSpec ring_a = allreduce("ra", 100000), ring_b = allreduce("rb", 200000);
  CHECK_THAT(outcome(false, {unit(ring_a), unit(ring_b)}, true), Catch::Contains("accepted"));
  CHECK_THAT(
      outcome(false, {unit(ring_a), unit(allreduce("r64", 100000, DataType::kFloat64))}, true),
      Catch::Contains("one ring's batch of"));
  CHECK_THAT(outcome(false, {unit(a32), unit(allreduce("c", 3))}, true),
             Catch::Contains("one ring's batch of"));
  CHECK_THAT(outcome(false, {unit(broadcast)}, true), Catch::Contains("one ring's batch of"));
  // Its kind survives the wire, and no other kind does.
  ResponseList response;
  response.batches.push_back({false, {unit(ring_a), unit(ring_b)}, true});
  std::vector<uint8_t> bytes;
  encode(response, bytes);
  ResponseList decoded = decode_responses(bytes.data(), bytes.size(), 3, cache);
  REQUIRE(decoded.batches.size() == 1);
  CHECK(decoded.batches[0].one_ring);
  CHECK_FALSE(decoded.batches[0].fused);
  bytes[13] = 3;  // the batch's kind, after idle (1), the last joined rank (4) and two counts (8)
  CHECK(refused_responses(bytes, 3));
}

// The largest single allocation since the test reset it: every operator new of this program
// passes here. One far beyond anything these tests need fails at once with std::bad_alloc, so
// that a decoder that sizes a vector by a count from the wire fails the test below instead of
// filling the machine's memory.
namespace {
std::atomic<size_t> largest_allocation{0};
constexpr size_t kRefusedAllocation = size_t{256} << 20;
}  // namespace

// None of them is inlined: GCC would see malloc() and free() meet new and delete, and warn.
[[gnu::noinline]] void* operator new(size_t bytes) {
  size_t seen = largest_allocation.load(std::memory_order_relaxed);
  while (bytes > seen && !largest_allocation.compare_exchange_weak(seen, bytes)) {
  }
  if (bytes > kRefusedAllocation) throw std::bad_alloc();
  if (void* memory = std::malloc(bytes == 0 ? 1 : bytes)) return memory;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* memory) noexcept {
  std::free(memory);
}
[[gnu::noinline]] void operator delete(void* memory, size_t) noexcept {
  std::free(memory);
}
// The nothrow forms too (std::stable_sort's temporary buffer uses them): left to the runtime, an
// AddressSanitizer build would take that memory from its own operator new and see it come back to
// free() above, which it reports as a mismatch.
[[gnu::noinline]] void* operator new(size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(bytes);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
[[gnu::noinline]] void operator delete(void* memory, const std::nothrow_t&) noexcept {
  std::free(memory);
}

// A count is bounded by the bytes left, but an element costs more in memory than on the wire (a
// 5-byte cache hit is an 88-byte ResponseUnit): a 64 MiB payload that claims 13 million units
// must not make the decoder allocate 1.2 GB before it reads the first one.
TEST_CASE("decoders allocate as elements arrive, never by a count from the wire",
          "[fusion_units]") {
  const size_t payload = kMaxPayloadBytes;
  auto put_u32 = [](std::vector<uint8_t>& bytes, size_t at, uint64_t value) {
    const uint32_t word = static_cast<uint32_t>(value);
    std::memcpy(bytes.data() + at, &word, 4);
  };
  ResponseCache cache(64);
  cache.store(0, allreduce("a", 1));
  auto largest_while = [&](auto decode) {
    largest_allocation = 0;
    std::string outcome = "accepted";
    try {
      decode();
    } catch (const Error& error) {
      outcome = error.what();
    } catch (const std::bad_alloc&) {
      outcome = "std::bad_alloc";
    }
    INFO(outcome);
    CHECK(outcome.find("malformed") != std::string::npos);
    return largest_allocation.load();
  };
  auto response = [&](const std::vector<uint8_t>& bytes) {
    return [&] { decode_responses(bytes.data(), bytes.size(), 3, cache); };
  };
  std::vector<uint8_t> bytes(payload, 0);  // idle 0, 0 errors, 0 batches, then zeros
  // Errors: as many as 12 bytes each allow; the first has status 0, which is malformed.
  put_u32(bytes, 1, (payload - 5) / 12);
  CHECK(largest_while(response(bytes)) < (size_t{1} << 20));
  // Batches of at least 5 bytes each; the first has 0 units.
  put_u32(bytes, 1, 0);
  put_u32(bytes, 5, (payload - 9) / 5);
  CHECK(largest_while(response(bytes)) < (size_t{1} << 20));
  // One batch of units of at least 5 bytes each: every one a hit of slot 0, which a response
  // may name once only.
  put_u32(bytes, 5, 1);
  put_u32(bytes, 10, (payload - 14) / 5);
  for (size_t at = 14; at + 5 <= payload; at += 5) bytes[at] = 1;  // hit, slot 0
  CHECK(largest_while(response(bytes)) < (size_t{1} << 20));
  // Announcements of at least 27 bytes each; the first has kind 0.
  std::vector<uint8_t> requests(payload, 0);
  put_u32(requests, 4, (payload - 8) / 27);
  CHECK(largest_while([&] { decode_requests(requests.data(), requests.size(), 3, 64); }) <
        (size_t{1} << 20));
}

// ---- the autotuner's settings on the wire, and its search -------------------------------------

TEST_CASE("a response's settings round-trip; bad ones are refused", "[fusion_units][autotune]") {
  ResponseList response;
  response.batches.push_back({false, {{false, -1, allreduce("t", 8)}}});
  std::vector<uint8_t> without;
  encode(response, without);
  response.settings = EngineSettings{uint64_t{16} << 20, 2.5, uint64_t{4} << 20, true};
  std::vector<uint8_t> bytes;
  encode(response, bytes);
  CHECK(bytes.size() == without.size() + 1 + 8 + 8 + 8 + 1);  // appended: the old form stands
  ResponseCache cache(16);
  ResponseList back = decode_responses(bytes.data(), bytes.size(), 2, cache);
  REQUIRE(back.settings);
  CHECK(*back.settings == *response.settings);
  CHECK_FALSE(decode_responses(without.data(), without.size(), 2, cache).settings);

  // Each field at a value its variable refuses, and a wrong tag, a truncated section, a byte more.
  const size_t section = without.size();
  auto with = [&](size_t offset, auto value) {
    std::vector<uint8_t> changed = bytes;
    std::memcpy(changed.data() + section + offset, &value, sizeof(value));
    return changed;
  };
  CHECK(refused_responses(with(0, uint8_t{2}), 2));                          // the tag
  CHECK(refused_responses(with(1, (uint64_t{4} << 30) + 1), 2));            // threshold > 4G
  CHECK(refused_responses(with(9, 0.0), 2));                                // cycle 0 ms
  CHECK(refused_responses(with(9, 10000.5), 2));                            // cycle > 10 s
  CHECK(refused_responses(with(9, std::numeric_limits<double>::quiet_NaN()), 2));
  CHECK(refused_responses(with(17, uint64_t{4095}), 2));                    // segment < 4K
  CHECK(refused_responses(with(17, (uint64_t{256} << 20) + 1), 2));         // segment > 256M
  CHECK(refused_responses(with(25, uint8_t{2}), 2));                        // final flag
  std::vector<uint8_t> shorter(bytes.begin(), bytes.end() - 1);
  CHECK(refused_responses(shorter, 2));
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  CHECK(refused_responses(longer, 2));
  // The limits themselves are accepted.
  CHECK_FALSE(refused_responses(with(1, uint64_t{4} << 30), 2));
  CHECK_FALSE(refused_responses(with(17, uint64_t{4096}), 2));
}

namespace {

// A synthetic job: each setting has a throughput, its busy time per step follows from it, and the
// tuner is fed one idle-terminated step of `step_bytes` at a time.
struct SyntheticJob {
  std::function<double(const EngineSettings&)> throughput;  // bytes per second
  uint64_t step_bytes = 100 << 20;
  Clock::time_point now = Clock::now();

  // Runs steps under the tuner's settings until it returns new ones (or `limit` steps pass).
  std::optional<EngineSettings> steps(Autotuner& tuner, int limit, int& taken) {
    for (taken = 0; taken < limit; ++taken) {
      now += std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(step_bytes / throughput(tuner.current())));
      std::optional<EngineSettings> next = tuner.observe(step_bytes, now, true);
      now += std::chrono::seconds(3);  // asleep between steps: not measured
      tuner.resume(now);
      if (next) return next;
    }
    return std::nullopt;
  }
};

}  // namespace

TEST_CASE("the autotuner finds the best setting of a separable job and settles",
          "[fusion_units][autotune]") {
  const uint64_t kMiB = 1 << 20;
  SyntheticJob job;
  // Best: cycle 1 ms, threshold 16M, segment 4M; each parameter's effect is independent.
  job.throughput = [&](const EngineSettings& s) {
    double score = 1e9;
    score /= 1 + std::fabs(std::log2(s.cycle_time_ms / 1.0)) * 0.1;
    score /= 1 + std::fabs(std::log2((s.fusion_threshold + kMiB) / double(17 * kMiB))) * 0.05;
    score /= 1 + std::fabs(std::log2(s.segment_bytes / double(4 * kMiB))) * 0.07;
    return score;
  };
  auto path = std::filesystem::temp_directory_path() /
              ("kolo_autotune_units_" + std::to_string(::getpid()) + ".csv");
  Autotuner tuner(EngineSettings{64 * kMiB, 5, kMiB, false}, AutotuneOptions{0.25, 1, path},
                  job.now);
  int changes = 0, taken = 0, steps = 0;
  std::optional<EngineSettings> last;
  while (auto next = job.steps(tuner, 1000, taken)) {
    steps += taken;
    ++changes;
    last = next;
    CHECK(next->final == tuner.settled());
    if (next->final) break;
  }
  REQUIRE(last);
  CHECK(last->final);
  CHECK(tuner.settled());
  CHECK(*last == EngineSettings{16 * kMiB, 1, 4 * kMiB, true});
  // Start on every list: one trial for it and one for every other value of each list.
  CHECK(tuner.trials() == Autotuner::max_trials() - 3);
  CHECK(changes == tuner.trials());  // a change after every trial, the last one final
  // 100 MiB at <= 1 GB/s is >= 0.1 s a step: the window of 0.25 s holds 3 steps or fewer.
  CHECK(steps <= 3 * (tuner.trials() + 1) + 3);
  // Settled: nothing changes any more.
  CHECK_FALSE(job.steps(tuner, 200, taken));
  CHECK(tuner.current() == *last);

  std::ifstream log(path);
  std::vector<std::string> rows;
  for (std::string line; std::getline(log, line);) rows.push_back(line);
  std::filesystem::remove(path);
  REQUIRE(rows.size() == 1 + 1 + static_cast<size_t>(tuner.trials()) + 1);
  CHECK(rows[0] ==
        "trial,fusion_threshold_bytes,cycle_time_ms,segment_bytes,bytes,busy_s,"
        "score_bytes_per_s,outcome");
  CHECK(rows[1].rfind("0,67108864,5,1048576,", 0) == 0);
  CHECK(rows[1].substr(rows[1].rfind(',')) == ",warmup");
  CHECK(rows[2].rfind("1,67108864,5,1048576,", 0) == 0);
  CHECK(rows[2].substr(rows[2].rfind(',')) == ",kept");
  CHECK(rows.back().find(",16777216,1,4194304,") != std::string::npos);
  CHECK(rows.back().substr(rows.back().rfind(',')) == ",final");
}

TEST_CASE("the autotuner keeps the start when nothing beats it, and ignores empty windows",
          "[fusion_units][autotune]") {
  SyntheticJob job;
  const EngineSettings start{3 << 20, 3.5, 2 << 20, false};  // on none of the lists
  job.throughput = [&](const EngineSettings& s) { return s == start ? 2e9 : 1e9; };
  Autotuner tuner(start, AutotuneOptions{0.05, 1, ""}, job.now);
  // Windows in which nothing ran do not count.
  for (int i = 0; i < 10; ++i) {
    job.now += std::chrono::milliseconds(200);
    CHECK_FALSE(tuner.observe(0, job.now, true));
  }
  int taken = 0, changes = 0;
  std::optional<EngineSettings> last;
  while (auto next = job.steps(tuner, 1000, taken)) {
    ++changes;
    last = next;
    if (next->final) break;
  }
  REQUIRE(last);
  CHECK(tuner.trials() == Autotuner::max_trials());  // every value of every list was tried
  CHECK(*last == EngineSettings{start.fusion_threshold, 3.5, start.segment_bytes, true});
}

TEST_CASE("the autotuner's window ends at a step's end, or at twice its time",
          "[fusion_units][autotune]") {
  Clock::time_point now = Clock::now();
  const auto tick = std::chrono::milliseconds(125);  // exact in binary: the sums are too
  Autotuner tuner(EngineSettings{1 << 20, 5, 1 << 20, false}, AutotuneOptions{1.0, 0, ""}, now);
  // Busy for 1.5 s without an idle response: no decision yet.
  for (int i = 1; i <= 12; ++i) CHECK_FALSE(tuner.observe(1000, now + i * tick, false));
  // An idle response ends the window.
  CHECK(tuner.observe(1000, now + 13 * tick, true));
  CHECK(tuner.trials() == 1);
  // Never idle: the window ends at 2 s.
  now += 13 * tick;
  for (int i = 1; i < 16; ++i) CHECK_FALSE(tuner.observe(1000, now + i * tick, false));
  CHECK(tuner.observe(1000, now + 16 * tick, false));
  CHECK(tuner.trials() == 2);
}

TEST_CASE("a window's score is its median step's, so one slow step does not decide it",
          "[fusion_units][autotune]") {
  auto path = std::filesystem::temp_directory_path() /
              ("kolo_autotune_median_" + std::to_string(::getpid()) + ".csv");
  Clock::time_point now = Clock::now();
  Autotuner tuner(EngineSettings{1 << 20, 5, 1 << 20, false}, AutotuneOptions{1.5, 0, path}, now);
  const uint64_t step = 250'000'000;
  // 0.25 s, then 1 s (another process took the cores), then 0.25 s: 1.5 s, three steps.
  for (double seconds : {0.25, 1.0, 0.25}) {
    now += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    auto next = tuner.observe(step, now, true);
    CHECK(next.has_value() == (seconds == 0.25 && tuner.trials() == 1));
  }
  std::ifstream log(path);
  std::string header, row;
  std::getline(log, header);
  std::getline(log, row);
  std::filesystem::remove(path);
  // The total would be 750 MB / 1.5 s = 0.5 GB/s; the median step ran at 1 GB/s.
  CHECK(row == "1,1048576,5,1048576,750000000,1.500000,1000000000,kept");
}

// ---- the engine's own thread -------------------------------------------------------------------

TEST_CASE("shutdown from the engine's own thread (a completion callback) does not join itself",
          "[fusion_units]") {
  ConfigOverrides overrides;
  overrides.rank = 0;
  overrides.size = 1;
  overrides.addr = "127.0.0.1:" + std::to_string(kolo::test::free_tcp_port());
  overrides.secret = kolo::test::kTestSecret;
  overrides.timeout_s = 30;
  auto communicator = std::make_unique<Communicator>(overrides);
  FusionEngine& engine = communicator->fusion();

  std::thread::id callback_thread;
  std::string shutdown_error = "the callback did not run";
  float value = 1;
  NamedTensor tensor{"stops-its-engine", &value, &value, 1};
  SubmitOptions options;
  options.callback = [&](Status) {
    callback_thread = std::this_thread::get_id();
    try {
      engine.shutdown();  // as kolo_comm_destroy would from a callback
      shutdown_error.clear();
    } catch (const std::exception& error) {
      shutdown_error = error.what();
    }
  };
  std::shared_ptr<Request> request =
      engine.allreduce(std::span(&tensor, 1), DataType::kFloat32, ReduceOp::kSum, options);
  CHECK(request->wait() == Status::kSuccess);
  CHECK(callback_thread != std::this_thread::get_id());  // it ran on the engine's thread
  INFO("shutdown() in the callback threw: " << shutdown_error);
  CHECK(shutdown_error.empty());
  // The engine has stopped, as after any shutdown: what comes later is refused.
  NamedTensor later{"after-shutdown", &value, &value, 1};
  try {
    engine.allreduce(std::span(&later, 1), DataType::kFloat32, ReduceOp::kSum, {});
    FAIL("a submission after shutdown was accepted");
  } catch (const Error& error) {
    CHECK(error.status() == Status::kCancelled);
  }
  communicator.reset();  // shuts the engine down again: nothing left to do
}
