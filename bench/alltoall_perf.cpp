// alltoall_perf: kolo_alltoall timed and checked like nccl-tests' alltoall_perf.
//
// A row of S bytes: every rank sends S/N bytes to every rank (itself included) from its S-byte
// sendbuf; the count column is the per-peer count. Each rank sends (N-1)/N of S over its links,
// so busbw = algbw * (N-1)/N. In place, sendbuf == recvbuf (kolo then copies the send data aside
// first).
#include "perf_common.hpp"

namespace {

using kolo::bench::Operation;
using kolo::bench::Shape;

double busbw_factor(int ranks) {
  return static_cast<double>(ranks - 1) / ranks;
}

Shape shape(uint64_t bytes, size_t element_size, int /*rank*/, int ranks) {
  const uint64_t per_peer = bytes / element_size / static_cast<uint64_t>(ranks);
  const uint64_t total = per_peer * static_cast<uint64_t>(ranks);
  return Shape{per_peer, total, total, 0, 0};
}

kolo_status_t run(const Operation& operation, const void* sendbuf, void* recvbuf) {
  return kolo_alltoall(operation.comm, sendbuf, recvbuf, operation.shape.count, operation.dtype);
}

// The block for peer p holds this rank's input elements [p * count, (p + 1) * count), so what
// rank r receives from rank q is q's input at r's block.
void init_input(const Operation& operation, void* sendbuf) {
  kolo::bench::fill_input(operation, operation.rank, sendbuf, operation.shape.send_count, 0);
}

void expected_output(const Operation& operation, void* expected) {
  const uint64_t count = operation.shape.count;
  auto* out = static_cast<std::byte*>(expected);
  for (int source = 0; source < operation.ranks; ++source) {
    kolo::bench::fill_input(operation, source,
                            out + count * source * kolo_dtype_size(operation.dtype), count,
                            count * operation.rank);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const kolo::bench::Collective alltoall = {
      .name = "alltoall",
      .reduces = false,
      .rooted = false,
      .busbw_factor = busbw_factor,
      .shape = shape,
      .run = run,
      .init_input = init_input,
      .expected_output = expected_output,
  };
  return kolo::bench::run_benchmark(argc, argv, alltoall);
}
