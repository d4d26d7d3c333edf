// The fusion engine's negotiation (src/fusion/wire.hpp, coordinator.hpp, fused_layout.hpp) on
// what authenticated peers send. The first byte chooses the side:
//  - rank 0 (even): the rest is cut into request lists (a u16 length, then that many bytes), one
//    per rank and cycle, for a few cycles. What decodes goes to the coordinator, whose response
//    (with the autotuner's settings in even cycles, chosen from its lists) must encode within the
//    payload limit and decode again as a member decodes it, settings included, passing every
//    check of a response; every rank's cache then takes its slot assignments.
//  - a member (odd): the rest is one response, decoded against a cache that holds units of several
//    kinds and dtypes. What decodes is copied as the executor copies a fused batch: every member
//    through one fusion buffer with the first unit's element size, from and to a buffer of the
//    member's own size, so that a batch that is not fusable is a copy past a buffer. Settings
//    that decode are within what their KOLO_* variables accept.
#include <cstddef>

#include "core/config.hpp"
#include "fusion/autotune.hpp"
#include "fusion/coordinator.hpp"
#include "fusion/fused_layout.hpp"
#include "fuzz_input.hpp"

using namespace kolo;
using namespace kolo::fusion;

namespace {

constexpr int kMaxCycles = 4;
constexpr uint32_t kCapacities[] = {0, 1, 4, 64, 100};
constexpr uint64_t kThresholds[] = {0, 64, 4096, uint64_t{64} << 20};
constexpr uint64_t kMaxCopiedElements = 1 << 16;  // larger batches are decoded, not copied

void as_rank_zero(FuzzInput& input) {
  const int ranks = 2 + input.take<uint8_t>() % 4;
  ResponseCache cache(kCapacities[input.take<uint8_t>() % std::size(kCapacities)]);
  const uint64_t threshold = kThresholds[input.take<uint8_t>() % std::size(kThresholds)];
  Coordinator coordinator(CoordinatorSettings{ranks, 0.0, 0.0}, cache);
  for (uint64_t cycle = 1; cycle <= kMaxCycles && input.left() > 0; ++cycle) {
    std::vector<RequestList> lists(static_cast<size_t>(ranks));
    try {
      for (RequestList& list : lists) {
        const std::vector<uint8_t> bytes = input.take_bytes(input.take<uint16_t>());
        list = decode_requests(bytes.data(), bytes.size(), ranks, cache.capacity());
      }
      ResponseList response = coordinator.process(
          cycle, lists, threshold, Clock::time_point(std::chrono::seconds(cycle)));
      if (cycle % 2 == 0) {  // a setting the autotuner may send, chosen without taking input
        const auto& cycles = Autotuner::kCycleTimesMs;
        const auto& thresholds = Autotuner::kThresholds;
        const auto& segments = Autotuner::kSegments;
        const size_t pick = cycle * 7 + static_cast<size_t>(ranks);
        response.settings =
            EngineSettings{thresholds[pick % thresholds.size()], cycles[pick % cycles.size()],
                           segments[pick % segments.size()], cycle == uint64_t{kMaxCycles}};
      }
      std::vector<uint8_t> bytes;
      encode(response, bytes);
      FUZZ_REQUIRE(bytes.size() <= kMaxPayloadBytes);
      try {
        const ResponseList decoded = decode_responses(bytes.data(), bytes.size(), ranks, cache);
        FUZZ_REQUIRE(decoded.settings == response.settings);
      } catch (const Error& error) {
        std::fprintf(stderr, "rank 0's own response is refused: %s\n", error.what());
        FUZZ_REQUIRE(!"the coordinator's response decodes");
      }
      for (const Batch& batch : response.batches) {
        for (const ResponseUnit& unit : batch.units) {
          if (!unit.hit && unit.slot >= 0) cache.store(static_cast<uint32_t>(unit.slot), unit.spec);
        }
      }
    } catch (const Error&) {
      return;  // a malformed list, or bits for an empty slot: refused, as the engine refuses it
    }
  }
}

void as_member(FuzzInput& input) {
  constexpr int kRanks = 3;
  ResponseCache cache(8);
  UnitSpec spec;
  spec.members = {{"f32", 7}};
  cache.store(0, spec);
  spec.dtype = DataType::kFloat64;
  spec.members = {{"f64", 5}, {"f64.b", 2}};
  cache.store(1, spec);
  spec.dtype = DataType::kInt8;
  spec.members = {{"i8", 9}};
  cache.store(2, spec);
  spec.kind = Kind::kBroadcast;
  spec.root = 1;
  spec.members = {{"broadcast", 4}};
  cache.store(3, spec);

  const std::vector<uint8_t> bytes = input.take_bytes(input.left());
  ResponseList response;
  try {
    response = decode_responses(bytes.data(), bytes.size(), kRanks, cache);
  } catch (const Error&) {
    return;
  }
  if (response.settings) {
    const EngineSettings& settings = *response.settings;
    FUZZ_REQUIRE(settings.fusion_threshold <= kMaxFusionThresholdBytes);
    FUZZ_REQUIRE(settings.cycle_time_ms > 0 && settings.cycle_time_ms <= kMaxCycleTimeMs);
    FUZZ_REQUIRE(settings.segment_bytes >= kSmallestSegmentBytes &&
                 settings.segment_bytes <= kLargestSegmentBytes);
  }
  for (const Batch& batch : response.batches) {
    FUZZ_REQUIRE(!(batch.fused && batch.one_ring));
    if (batch.one_ring) {  // one ring allreduce over the units' buffers: one dtype, the ring's
      const UnitSpec* first = spec_of(batch.units.front(), cache);
      for (const ResponseUnit& unit : batch.units) {
        const UnitSpec* unit_spec = spec_of(unit, cache);
        FUZZ_REQUIRE(unit_spec->kind == Kind::kAllreduce && unit_spec->dtype == first->dtype);
        FUZZ_REQUIRE(engine_algorithm(*unit_spec, kRanks) == Algorithm::kRing);
      }
    }
    if (!batch.fused) continue;
    std::vector<std::pair<uint64_t, size_t>> members;  // count, element size
    uint64_t elements = 0;
    for (const ResponseUnit& unit : batch.units) {
      const UnitSpec* unit_spec = spec_of(unit, cache);
      for (const Member& member : unit_spec->members) {
        members.emplace_back(member.count, dtype_size(unit_spec->dtype));
        elements += member.count;
      }
    }
    if (elements > kMaxCopiedElements) continue;
    std::vector<uint64_t> counts;
    for (const auto& member : members) counts.push_back(member.first);
    const FusedLayout layout(counts, kRanks);
    const size_t element = dtype_size(spec_of(batch.units.front(), cache)->dtype);
    std::vector<std::byte> buffer(layout.total_elements() * element);
    for (size_t m = 0; m < members.size(); ++m) {
      std::vector<std::byte> tensor(members[m].first * members[m].second);
      layout.copy_in(m, tensor.data(), buffer.data(), element);
      layout.copy_out(m, buffer.data(), tensor.data(), element);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput input(data, size);
  if (input.take<uint8_t>() % 2 == 0) {
    as_rank_zero(input);
  } else {
    as_member(input);
  }
  return 0;
}
