// The ring allreduce over several buffers at once (ring_allreduce_pieces, ring/allreduce.cpp),
// three ranks run as threads of this process over real transports: every piece must come out
// bitwise as ring_allreduce makes it alone, on the same inputs, for pieces empty, shorter than N,
// uneven and long, in place and not, with partials in the output and in the float32 shadow (half
// types), with and without a prescale, and with segments small enough that pieces span many.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/op_descriptor.hpp"
#include "ring/ring.hpp"
#include "ring_threads.hpp"
#include "transport/transport.hpp"

namespace {

using ring_threads::random_elements;

constexpr int kRanks = 3;

struct Case {
  std::string name;
  kolo::DataType dtype;
  kolo::ReduceOp op;
  double prescale;
  double postscale;
  size_t segment_bytes;
  bool in_place;
  std::vector<uint64_t> counts;
};

}  // namespace

TEST_CASE("one ring over several buffers reduces each bitwise as alone", "[ring_pieces]") {
  using kolo::DataType;
  using kolo::ReduceOp;
  const std::vector<Case> cases = {
      {"float32 sum, in place, 1 KiB segments",
       DataType::kFloat32,
       ReduceOp::kSum,
       1.0,
       1.0,
       1024,
       true,
       {5000, 0, 1, 2, 3, 7, 40001, 0, 999}},
      {"float32 avg, prescaled, apart",
       DataType::kFloat32,
       ReduceOp::kAvg,
       0.75,
       1.5,
       4096,
       false,
       {1, 70000, 0, 12345, 2}},
      {"float64 max, apart, one segment a chunk",
       DataType::kFloat64,
       ReduceOp::kMax,
       1.0,
       1.0,
       1 << 20,
       false,
       {3000, 3001, 3002}},
      {"float16 sum (float32 partials), in place",
       DataType::kFloat16,
       ReduceOp::kSum,
       1.0,
       1.0,
       512,
       true,
       {2, 9000, 0, 17, 30000}},
      {"float16 avg, prescaled, apart",
       DataType::kFloat16,
       ReduceOp::kAvg,
       0.5,
       2.0,
       2048,
       false,
       {4097, 1, 8191}},
      {"only empty pieces", DataType::kFloat32, ReduceOp::kSum, 1.0, 1.0, 1024, true, {0, 0}},
      {"one piece", DataType::kFloat32, ReduceOp::kSum, 1.0, 1.0, 1024, false, {33333}},
  };
  for (const std::string transport : {"tcp", "ucx"}) {
    if (!ring_threads::built_with(transport)) continue;
    for (const Case& c : cases) {
      DYNAMIC_SECTION(transport << ": " << c.name) {
        const size_t element = kolo::dtype_size(c.dtype);
        // [rank][piece]: the inputs, the pieces' results and each piece's result alone.
        std::vector<std::vector<std::vector<std::byte>>> inputs(kRanks), together(kRanks),
            alone(kRanks);
        for (int rank = 0; rank < kRanks; ++rank) {
          for (size_t p = 0; p < c.counts.size(); ++p) {
            inputs[rank].push_back(random_elements(c.dtype, c.counts[p], rank * 100 + p));
            together[rank].emplace_back(c.counts[p] * element, std::byte{0x5a});
            alone[rank].emplace_back(c.counts[p] * element, std::byte{0xa5});
          }
        }
        kolo::TransportSettings settings;
        settings.transport = transport;
        ring_threads::on_every_rank(
            kRanks, settings, c.segment_bytes, [&](int rank, kolo::Ring& ring) {
              kolo::OpDescriptor op;
              op.collective = kolo::Collective::kAllreduce;
              op.dtype = c.dtype;
              op.op = c.op;
              op.prescale = c.prescale;
              op.postscale = c.postscale;
              op.algorithm = kolo::Algorithm::kRing;
              std::vector<kolo::AllreducePiece> pieces;
              op.count = 0;
              for (size_t p = 0; p < c.counts.size(); ++p) {
                std::vector<std::byte>& out = together[rank][p];
                if (c.in_place) out = inputs[rank][p];
                pieces.push_back(
                    {c.in_place ? out.data() : inputs[rank][p].data(), out.data(), c.counts[p]});
                op.count += c.counts[p];
              }
              op.sequence = 1;
              kolo::ring_allreduce_pieces(ring, op, pieces);
              for (size_t p = 0; p < c.counts.size(); ++p) {
                op.count = c.counts[p];
                op.sequence = 2 + p;
                kolo::ring_allreduce(ring, op, inputs[rank][p].data(), alone[rank][p].data());
              }
            });
        for (int rank = 0; rank < kRanks; ++rank) {
          for (size_t p = 0; p < c.counts.size(); ++p) {
            INFO("rank " << rank << ", piece " << p << " of " << c.counts[p] << " elements");
            CHECK(together[rank][p] == alone[rank][p]);
            // Every rank holds the same result.
            CHECK(together[rank][p] == together[0][p]);
          }
        }
        // And the result is the reduction: for the float32 sum, against a sum in double.
        if (c.dtype == DataType::kFloat32 && c.op == ReduceOp::kSum) {
          for (size_t p = 0; p < c.counts.size(); ++p) {
            for (uint64_t i = 0; i < c.counts[p]; ++i) {
              double expected = 0;
              for (int rank = 0; rank < kRanks; ++rank) {
                float value;
                std::memcpy(&value, inputs[rank][p].data() + i * 4, 4);
                expected += value;
              }
              float got;
              std::memcpy(&got, together[0][p].data() + i * 4, 4);
              if (std::abs(got - expected) > 1e-4) {
                FAIL("piece " << p << " element " << i << ": " << got << " instead of "
                              << expected);
              }
            }
          }
        }
      }
    }
  }
}
