// Recursive doubling's one-shot form (ring/allreduce_recursive_doubling.cpp): where kolo's
// shared-memory rings link every pair, a small allreduce sends every partial to every rank at
// once and each rank combines them itself. It must give bitwise what the exchanges give. N ranks
// run as threads of this process, once over TCP with the rings (one shot where small enough) and
// once without them (the exchanges), on the same inputs; every result must match bitwise across
// the two runs and across ranks, and equal the exact sum where the inputs make it exact.
#include <sys/statvfs.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/op_descriptor.hpp"
#include "ring/algorithms.hpp"
#include "ring/ring.hpp"
#include "ring_threads.hpp"
#include "transport/shm/shm_channel.hpp"
#include "transport/transport.hpp"

namespace {

using kolo::DataType;
using kolo::ReduceOp;

struct Case {
  std::string name;
  DataType dtype;
  ReduceOp op;
  double prescale;
  double postscale;
  uint64_t count;
  bool in_place;
  bool integers = false;  // small_integers() as input: the sum is exact
};

// Integers in -1000..1000: float and int sums of a few of them are exact in any order.
std::vector<std::byte> small_integers(DataType dtype, uint64_t count, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<std::byte> bytes(count * kolo::dtype_size(dtype));
  for (uint64_t i = 0; i < count; ++i) {
    const int32_t value = static_cast<int32_t>(random() % 2001) - 1000;
    if (dtype == DataType::kInt32) {
      std::memcpy(bytes.data() + i * 4, &value, 4);
    } else {
      const float f = static_cast<float>(value);
      std::memcpy(bytes.data() + i * 4, &f, 4);
    }
  }
  return bytes;
}

// Element i of an int32 or float32 buffer, as a double (exactly).
double element_at(DataType dtype, const std::vector<std::byte>& bytes, uint64_t i) {
  if (dtype == DataType::kInt32) {
    int32_t value;
    std::memcpy(&value, bytes.data() + i * 4, 4);
    return value;
  }
  float value;
  std::memcpy(&value, bytes.data() + i * 4, 4);
  return value;
}

// The largest count whose partials a rank may send to all others in one shot.
uint64_t one_shot_limit(DataType dtype, int ranks) {
  return kolo::kOneShotMaxBytes /
         (static_cast<uint64_t>(ranks - 1) * kolo::accumulator_size(dtype));
}

// Whether /dev/shm has room for a segment per pair of `ranks` (a container's default 64 MiB
// holds them for 5 ranks, not for 8), twice over for the test running beside this one.
bool room_for_rings(int ranks) {
  struct statvfs shm {};
  if (::statvfs("/dev/shm", &shm) != 0) return false;
  const uint64_t pairs = static_cast<uint64_t>(ranks) * (ranks - 1) / 2;
  return static_cast<uint64_t>(shm.f_bavail) * shm.f_frsize >=
         2 * pairs * kolo::ShmChannel::segment_bytes();
}

// Runs case `c` as the collective numbered `sequence` on this rank's ring: `output` gets the
// result (it starts as the input in place, as a fill pattern otherwise).
void run_case(kolo::Ring& ring, const Case& c, uint64_t sequence, std::vector<std::byte> input,
              std::vector<std::byte>& output) {
  kolo::OpDescriptor op;
  op.collective = kolo::Collective::kAllreduce;
  op.algorithm = kolo::Algorithm::kRecursiveDoubling;
  op.dtype = c.dtype;
  op.op = c.op;
  op.prescale = c.prescale;
  op.postscale = c.postscale;
  op.count = c.count;
  op.sequence = sequence;
  output.assign(input.size(), std::byte{0x5a});
  if (c.in_place) output = input;
  kolo::recursive_doubling_allreduce(ring, op, c.in_place ? output.data() : input.data(),
                                     output.data());
}

}  // namespace

TEST_CASE("recursive doubling in one shot gives the exchanges' bits", "[one_shot]") {
  if (!ring_threads::built_with("tcp")) return;
  for (int ranks : {3, 4, 5, 8}) {
    if (!room_for_rings(ranks)) {
      WARN("skipped " << ranks << " ranks: /dev/shm has no room for a ring per pair");
      continue;
    }
    DYNAMIC_SECTION(ranks << " ranks") {
      const uint64_t limit32 = one_shot_limit(DataType::kFloat32, ranks);
      const uint64_t limit16 = one_shot_limit(DataType::kFloat16, ranks);
      const std::vector<Case> cases = {
          {"float32 sum", DataType::kFloat32, ReduceOp::kSum, 1.0, 1.0, 1000, false},
          {"float32 sum, one element, in place", DataType::kFloat32, ReduceOp::kSum, 1.0, 1.0, 1,
           true},
          {"float32 sum at the one-shot limit", DataType::kFloat32, ReduceOp::kSum, 1.0, 1.0,
           limit32, false},
          {"float32 sum just above it", DataType::kFloat32, ReduceOp::kSum, 1.0, 1.0, limit32 + 1,
           false},
          {"float32 avg, prescaled and postscaled", DataType::kFloat32, ReduceOp::kAvg, 0.75, 1.5,
           777, true},
          {"float64 prod", DataType::kFloat64, ReduceOp::kProd, 1.0, 1.0, 300, false},
          {"float64 min", DataType::kFloat64, ReduceOp::kMin, 1.0, 1.0, 5, false},
          {"float16 sum (float32 partials) at the limit", DataType::kFloat16, ReduceOp::kSum, 1.0,
           1.0, limit16, false},
          {"float16 avg, prescaled", DataType::kFloat16, ReduceOp::kAvg, 0.5, 1.0, 999, true},
          {"int32 sum", DataType::kInt32, ReduceOp::kSum, 1.0, 1.0, 2048, false, true},
          {"float32 sum of integers", DataType::kFloat32, ReduceOp::kSum, 1.0, 1.0, 4000, false,
           true},
      };
      // Each rank's input of case k, the same in both runs.
      auto input_of = [&](size_t k, int rank) {
        const Case& c = cases[k];
        const uint64_t seed = 1000 * static_cast<uint64_t>(ranks) + 10 * k + rank;
        return c.integers ? small_integers(c.dtype, c.count, seed)
                          : ring_threads::random_elements(c.dtype, c.count, seed);
      };
      std::vector<std::vector<std::vector<std::byte>>> results[2];  // [run][rank][case]
      std::vector<int> everywhere[2];
      for (int run = 0; run < 2; ++run) {
        results[run].assign(ranks, std::vector<std::vector<std::byte>>(cases.size()));
        everywhere[run].assign(ranks, -1);
        kolo::TransportSettings settings;
        settings.transport = "tcp";
        settings.shm.assign(1, run == 0 ? '1' : '0');  // KOLO_SHM
        ring_threads::on_every_rank(ranks, settings, 1 << 20, [&](int rank, kolo::Ring& ring) {
          everywhere[run][rank] = ring.transport().through_memory_everywhere() ? 1 : 0;
          for (size_t k = 0; k < cases.size(); ++k) {
            run_case(ring, cases[k], 1 + k, input_of(k, rank), results[run][rank][k]);
          }
        });
      }
      for (int rank = 0; rank < ranks; ++rank) {
        INFO("rank " << rank);
        CHECK(everywhere[0][rank] == 1);  // so the small cases ran in one shot
        CHECK(everywhere[1][rank] == 0);  // and here as exchanges
      }
      for (size_t k = 0; k < cases.size(); ++k) {
        const Case& c = cases[k];
        INFO(c.name << ", " << c.count << " elements");
        for (int rank = 0; rank < ranks; ++rank) {
          INFO("rank " << rank);
          CHECK(results[0][rank][k] == results[1][rank][k]);
          CHECK(results[0][rank][k] == results[0][0][k]);
        }
        if (!c.integers) continue;
        // Exact: the sum of the inputs, however it was combined.
        std::vector<std::vector<std::byte>> inputs;
        for (int rank = 0; rank < ranks; ++rank) inputs.push_back(input_of(k, rank));
        uint64_t wrong = 0;
        for (uint64_t i = 0; i < c.count; ++i) {
          double expected = 0;  // sums of a few integers below 2^53: exact
          for (const std::vector<std::byte>& input : inputs) {
            expected += element_at(c.dtype, input, i);
          }
          wrong += element_at(c.dtype, results[0][0][k], i) != expected ? 1 : 0;
        }
        CHECK(wrong == 0);
      }
    }
  }
}

// Two ranks whose inputs already are partials (no prescale, the element type its own accumulator)
// finish lower OP upper straight into recvbuf in one pass. That must give the bits the general
// path gives (combine the partials, then finish the sum with the op's identity), computed here
// from the inputs with the kernels themselves, NaN, infinities and signed zeros included.
TEST_CASE("two ranks finish in one pass with the bits of combine, then finish", "[two_ranks]") {
  if (!ring_threads::built_with("tcp")) return;
  const std::vector<Case> cases = {
      {"float32 sum", DataType::kFloat32, ReduceOp::kSum, 1.0, 1.0, 1000, false},
      {"float32 sum, one element, in place", DataType::kFloat32, ReduceOp::kSum, 1.0, 1.0, 1, true},
      {"float32 avg, postscaled, in place", DataType::kFloat32, ReduceOp::kAvg, 1.0, 1.5, 777,
       true},
      {"float32 min", DataType::kFloat32, ReduceOp::kMin, 1.0, 1.0, 333, false},
      {"float32 max, in place", DataType::kFloat32, ReduceOp::kMax, 1.0, 1.0, 333, true},
      {"float64 prod, postscaled", DataType::kFloat64, ReduceOp::kProd, 1.0, 0.25, 300, false},
      {"float64 sum, in place", DataType::kFloat64, ReduceOp::kSum, 1.0, 1.0, 64, true},
      {"int32 sum", DataType::kInt32, ReduceOp::kSum, 1.0, 1.0, 2048, false, true},
      {"int32 max, in place", DataType::kInt32, ReduceOp::kMax, 1.0, 1.0, 100, true, true},
  };
  // Rank `rank`'s input of case k; floats begin with NaN, infinities and signed zeros, on each
  // rank in another order, so that every pairing of them meets.
  auto input_of = [&](size_t k, int rank) {
    const Case& c = cases[k];
    const uint64_t seed = 77 + 10 * k + rank;
    std::vector<std::byte> bytes = c.integers
                                       ? small_integers(c.dtype, c.count, seed)
                                       : ring_threads::random_elements(c.dtype, c.count, seed);
    if (c.integers) return bytes;
    const double specials[] = {std::numeric_limits<double>::quiet_NaN(),
                               -0.0,
                               0.0,
                               std::numeric_limits<double>::infinity(),
                               -std::numeric_limits<double>::infinity(),
                               1.0};
    const size_t n = std::size(specials);
    for (uint64_t i = 0; i < std::min<uint64_t>(c.count, n * n); ++i) {
      const double value = specials[rank == 0 ? i / n : i % n];
      if (c.dtype == DataType::kFloat32) {
        const float f = static_cast<float>(value);
        std::memcpy(bytes.data() + i * 4, &f, 4);
      } else {
        std::memcpy(bytes.data() + i * 8, &value, 8);
      }
    }
    return bytes;
  };
  for (int rings = 0; rings < 2; ++rings) {
    DYNAMIC_SECTION((rings ? "over the rings" : "over TCP")) {
      std::vector<std::vector<std::vector<std::byte>>> results(
          2, std::vector<std::vector<std::byte>>(cases.size()));
      kolo::TransportSettings settings;
      settings.transport = "tcp";
      settings.shm.assign(1, rings ? '1' : '0');
      ring_threads::on_every_rank(2, settings, 1 << 20, [&](int rank, kolo::Ring& ring) {
        for (size_t k = 0; k < cases.size(); ++k) {
          run_case(ring, cases[k], 1 + k, input_of(k, rank), results[rank][k]);
        }
      });
      for (size_t k = 0; k < cases.size(); ++k) {
        const Case& c = cases[k];
        INFO(c.name << ", " << c.count << " elements");
        const std::vector<std::byte> lower = input_of(k, 0);
        const std::vector<std::byte> upper = input_of(k, 1);
        std::vector<std::byte> partial(lower.size());
        const kolo::ReduceSpec partial_spec{c.dtype, c.op, 1.0, 1.0, 2};
        kolo::reduce_combine(partial.data(), lower.data(), upper.data(), c.count, partial_spec);
        std::vector<std::byte> identity(lower.size());
        kolo::fill_identity(identity.data(), c.count, c.dtype, c.op);
        std::vector<std::byte> expected(lower.size());
        const kolo::ReduceSpec finish_spec{c.dtype, c.op, 1.0, c.postscale, 2};
        kolo::reduce_finish(expected.data(), partial.data(), identity.data(), c.count, finish_spec);
        CHECK(results[0][k] == expected);
        CHECK(results[1][k] == expected);
      }
    }
  }
}
